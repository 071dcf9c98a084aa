"""The profile tables measured on a lent H100 ship with the package and plan a GPU recipe on a
machine without a GPU: `batchinfer profile recipes/w-8b.yaml --table h100-llama-3.1-8b`."""
from __future__ import annotations

from pathlib import Path

import pytest

from batchinfer.engine.errors import ConfigError
from batchinfer.sim.profile_table import ProfileTable
from batchinfer.sim.shipped_tables import resolve_table, shipped_tables

REPO = Path(__file__).resolve().parents[2]


def test_every_shipped_table_loads_and_was_measured_on_a_gpu():
    names = shipped_tables()
    assert {"h100-llama-3.1-8b", "h100-smollm2-135m"} <= set(names)
    for name in names:
        table = ProfileTable.load(resolve_table(Path(name)))
        assert table.hardware["device"] == "cuda" and "H100" in table.hardware["card"]
        decode = [p for p in table.compute[1].points if p["kind"] == "decode"]
        # timed with the GPU's work in it: a bigger batch never takes less than a quarter longer
        # than batch 1 at the largest size, and no step is faster than reading the weights would
        # allow at 4 TB/s
        weights = table.model["num_params"] * table.model["dtype_bytes"]
        assert min(p["seconds"] for p in decode) > weights / 4e12 * 0.5
        assert max(p["seconds"] for p in decode) > 1.25 * min(p["seconds"] for p in decode)


def test_a_name_that_is_neither_file_nor_shipped_lists_the_shipped_ones(tmp_path):
    with pytest.raises(ConfigError, match="h100-llama-3.1-8b"):
        resolve_table(Path("a100-nothing"))
    own = tmp_path / "h100-llama-3.1-8b.json"      # a file of that name wins over the shipped one
    own.write_text("{}")
    assert resolve_table(own) == own


@pytest.mark.slow
def test_a_cuda_recipe_plans_on_this_machine_from_the_shipped_table(tmp_path):
    from batchinfer.runner.recipe import load_recipe
    from batchinfer.sim.planner import plan

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "Tell me about the number {i}."}}\n'
                               for i in range(24)))
    result = plan(load_recipe(REPO / "recipes" / "w-8b.yaml"), prompts, tmp_path / "out",
                  table=Path("h100-llama-3.1-8b"), max_requests=24)
    assert result.setup.description["device"] == "cuda"
    assert result.ranked and result.ranked[0].result.output_tok_per_s > 0
    assert result.best_recipe is not None


def test_a_measured_gpu_table_plans_for_the_gpus_it_was_profiled_with(tmp_path):
    """A table profiled on a machine of N GPUs plans layouts over N ranks unless --gpus says
    otherwise; a table that does not say (the shipped ones, from one H100) plans for 1."""
    import json

    from batchinfer.engine.runtime.build import model_setup
    from batchinfer.runner.recipe import load_recipe
    from batchinfer.sim.planner import _read_on_this_machine, measured_setup

    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml")
    model = model_setup(_read_on_this_machine(recipe.engine_config(), True))
    shipped = resolve_table(Path("h100-smollm2-135m"))
    four = tmp_path / "four-gpus.json"
    data = json.loads(shipped.read_text())
    data["hardware"]["gpus"] = 4
    four.write_text(json.dumps(data))

    def ranks(table, gpus=None):
        return measured_setup(recipe, model, table, tmp_path, gpus, lambda *a: None).devices

    assert ranks(shipped) == 1
    assert ranks(four) == 4
    assert ranks(four, gpus=2) == 2
