"""A knob set in the recipe that a part switched off leaves with nothing to do (the papers'
ablations: `compute_service: false` and a B_th, `cpu_sampling: false` and a pool size) is
warned of by name where the layout notes are (validate, run --dry-run, the engine's build),
never refused: an ablation recipe keeps the knobs of the part it turns off."""
from __future__ import annotations

import pytest

from batchinfer.engine.config import ParallelConfig
from batchinfer.strategies import STRATEGIES

# (strategy, the part off, knobs it leaves unused, the same knobs with the part on)
CASES = [
    ("sidp", {"compute_service": False},
     {"batch_threshold": 8, "gemm_fusion": False, "dummy_skipping": False,
      "mode_switch_patience": 4, "mode_switch_hysteresis": 2.0}, {"compute_service": True}),
    ("sipipe", {"cpu_sampling": False}, {"sampler_threads": 2, "split_columns": False},
     {"cpu_sampling": True}),
    ("gllm", {"WT": False}, {"T": 4}, {"WT": True}),
    ("tdpipe", {"greedy_prefill": False}, {"admit_within_capacity": True},
     {"greedy_prefill": True}),
    ("tdpipe", {"greedy_prefill": True}, {"kv_occupancy_ratio": 0.7},
     {"greedy_prefill": False}),
    ("tdpipe", {"intensity_switch": True}, {"finished_ratio": 0.3}, {"intensity_switch": False}),
    ("tdpipe", {"unsure_upper_forecast": False}, {"unsure_confidence": 0.3},
     {"unsure_upper_forecast": True}),
    ("seesaw", {"cpu_kv_tier": False}, {"cpu_kv_cache_memory": "8GiB"}, {"cpu_kv_tier": True}),
    ("seesaw", {"decode_tp": 1, "decode_pp": 2}, {"layout_costs": "h100"},
     {"decode_tp": "auto", "decode_pp": 2}),
]
LAYOUT = ParallelConfig(pp=2)


@pytest.mark.parametrize("name, off, knobs, on", CASES)
def test_a_set_knob_of_a_part_switched_off_is_named(name, off, knobs, on):
    notes = STRATEGIES[name](**off, **knobs).notes(LAYOUT)
    assert len(notes) == 1, notes
    for key in knobs:
        assert f"strategy.{key}" in notes[0]
    assert next(iter(off)) in notes[0] or "layout" in notes[0]      # says which part is off
    assert STRATEGIES[name](**on, **knobs).notes(LAYOUT) == []       # the part on: no word
    assert STRATEGIES[name](**off).notes(LAYOUT) == []               # knobs left alone: none


def test_validate_says_it_and_the_job_still_validates(tmp_path):
    from typer.testing import CliRunner

    from batchinfer.cli.main import app

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  max_model_len: 256\nparallel:\n  dp: 2\nstrategy:\n"
                      "  name: sidp\n  compute_service: false\n  batch_threshold: 16\n")
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(app, ["validate", str(recipe), "--input", str(prompts),
                                      "--no-tokenize"])
    assert result.exit_code == 0, result.output
    assert "strategy.batch_threshold has no effect: strategy.compute_service is false" in \
        " ".join(result.output.split())
