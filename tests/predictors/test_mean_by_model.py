"""A history that holds several models' replies (run directories merged, a history file
concatenated by hand): a `mean` predictor and `batchinfer profile --history` take the job's own
model's records where there are any, and say whose lengths they use where there are none."""
from __future__ import annotations

import json
import logging
from collections import Counter

import pytest

from batchinfer.engine.model.sources import model_id_for
from batchinfer.predictors import make_predictor
from batchinfer.predictors.history import models_for_job, sha256_text
from batchinfer.runner.predictor_setup import build_job_predictor
from batchinfer.runner.recipe import Recipe


def _history(run_dir, lengths_by_model: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for model, lengths in lengths_by_model.items():
        for i, out in enumerate(lengths):
            prompt = f"{model} prompt {i}"
            lines.append(json.dumps({"id": f"{model}-{i}", "prompt": prompt,
                                     "prompt_sha256": sha256_text(prompt), "prompt_tokens": 5,
                                     "output_tokens": out, "finish_reason": "stop",
                                     "model": model, "max_tokens": 512}))
    (run_dir / "history.jsonl").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("models, job, chosen, says", [
    ({"a": 3}, "a", None, None),                      # one model: nothing to choose
    ({None: 3}, "a", None, None),                     # records without a model
    ({"a": 2, "b": 5}, "a", {"a", None}, "2 records of a used, 5 of other models left out"),
    ({"b": 5, "c": 1}, "a", None, "no record of this job's model a: the lengths are the replies of b, c"),
])
def test_which_records_a_job_uses(models, job, chosen, says):
    assert models_for_job(Counter(models), job) == (chosen, says)


def test_a_mean_predictor_takes_its_own_models_records(tmp_path):
    _history(tmp_path / "run", {"a": [10, 20], "b": [100, 200]})
    recipe = Recipe(predictor={"name": "mean", "path": str(tmp_path / "run")})
    mean = make_predictor(recipe.predictor)
    assert mean.mean == pytest.approx(82.5)               # every record until told the model
    assert "2 records of a used" in mean.for_model("a")
    assert mean.mean == pytest.approx(15.0)
    other = make_predictor(recipe.predictor)
    assert "no record of this job's model c" in other.for_model("c")
    assert other.mean == pytest.approx(82.5)


def test_the_job_and_its_report_say_which_mean(tmp_path):
    model = Recipe().model
    job_model = model_id_for(model.path, False, model.hf_overrides)
    _history(tmp_path / "run", {job_model: [8, 12], "other-model": [300, 500, 700]})
    recipe = Recipe(predictor={"name": "mean", "path": str(tmp_path / "run")})
    predictor, choice = build_job_predictor(recipe, tmp_path / "runs" / "job")
    assert getattr(predictor, "base", predictor).mean == pytest.approx(10.0)   # online: wrapped
    assert f"mean output length 10.0 tokens: 2 records of {job_model} used, 3 of other " \
        "models left out" in choice["reason"]


def test_profile_history_lengths_are_the_models_own(tmp_path, caplog):
    from batchinfer.sim.workload import _history_lengths

    _history(tmp_path / "run", {"a": [4, 6], "b": [900]})
    lengths, source = _history_lengths([tmp_path / "run"], "a")
    assert sorted(lengths) == [4, 6] and "1 of other models left out" in source
    with caplog.at_level(logging.WARNING, logger="batchinfer.sim.workload"):
        lengths, _ = _history_lengths([tmp_path / "run"], "z")
    assert sorted(lengths) == [4, 6, 900]
    assert "no record of this job's model z" in caplog.text
