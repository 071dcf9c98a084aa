"""A predictor the recipe names (`predictor: {name: bert, path: ...}`): what the job says of it
when it cannot help (trained on another model's replies; a strategy that reads no forecast)."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from batchinfer.runner.predictor_setup import build_job_predictor
from batchinfer.runner.recipe import Recipe

SHIPPED = str(Path(__file__).resolve().parents[2] / "predictors" / "shipped"
              / "smollm2-135m-instruct")


def _choice(tmp_path, caplog, **recipe):
    caplog.set_level(logging.WARNING)
    recipe = Recipe(predictor={"name": "bert", "path": SHIPPED}, **recipe)
    predictor, choice = build_job_predictor(recipe, tmp_path / "run")
    assert predictor is not None
    return choice


def test_the_models_own_predictor_with_a_forecasting_strategy_is_named_by_its_path(tmp_path,
                                                                                 caplog):
    from batchinfer.runner.report.report import _predictor_line

    choice = _choice(tmp_path, caplog, strategy={"name": "tdpipe"})
    assert choice == {"name": "bert", "path": SHIPPED}
    assert not caplog.records
    assert _predictor_line(choice) == [f"**Length predictor:** bert ({SHIPPED})  "]


def test_a_predictor_trained_on_another_models_replies_is_said(tmp_path, caplog):
    choice = _choice(tmp_path, caplog, model={"path": "/models/Llama-3.2-1B-Instruct"},
                     strategy={"name": "tdpipe"})
    assert choice["name"] == "bert" and choice["path"] == SHIPPED
    assert "SmolLM2-135M-Instruct" in choice["reason"]
    assert "/models/Llama-3.2-1B-Instruct" in choice["reason"]
    assert "not of this job's model" in caplog.text


@pytest.mark.parametrize("strategy", ["baseline", "gllm"])
def test_a_strategy_that_reads_no_forecast_is_said(tmp_path, caplog, strategy):
    choice = _choice(tmp_path, caplog, strategy={"name": strategy})
    assert f"strategy {strategy} reads no length forecast" in choice["reason"]
    assert "reads no length forecast" in caplog.text


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is here")
def test_cuda_where_torch_sees_none_is_the_engines_usage_error_not_the_predictors_crash(tmp_path):
    """device.device: cuda on a CPU host with a bert predictor failed the job with exit 3 and
    torch's AssertionError ("rerun to resume"): the predictor loads before the engine."""
    from batchinfer.engine.errors import ConfigError

    recipe = Recipe(predictor={"name": "bert", "path": SHIPPED}, strategy={"name": "tdpipe"},
                    device={"device": "cuda"})
    with pytest.raises(ConfigError, match="device.device: cuda was asked for"):
        build_job_predictor(recipe, tmp_path / "run")


def test_a_path_for_a_predictor_that_reads_none_names_those_that_do(tmp_path):
    """The error said only bert and mean read a path: auto reads one too (the runs to learn
    from)."""
    from batchinfer.runner.recipe import RecipeError, parse_recipe

    with pytest.raises(RecipeError, match="only the auto, bert and mean predictors read a path"):
        parse_recipe({"predictor": {"name": "oracle", "path": str(tmp_path)}}, "r.yaml")


@pytest.mark.parametrize("name", ["bert", "mean", "auto"])
def test_a_path_at_a_file_says_so_and_names_its_directory(tmp_path, name):
    """predictor.path at predictor.json (or history.jsonl) said "no such directory"."""
    from batchinfer.runner.recipe import RecipeError, parse_recipe

    card = tmp_path / "predictor.json"
    card.write_text("{}")
    with pytest.raises(RecipeError, match=f"a file; give the directory holding it \\({tmp_path}\\)"):
        parse_recipe({"predictor": {"name": name, "path": str(card)}}, "r.yaml")
    other = tmp_path / "notes.txt"
    other.write_text("x")
    with pytest.raises(RecipeError, match="a file, not a directory"):
        parse_recipe({"predictor": {"name": name, "path": str(other)}}, "r.yaml")
    with pytest.raises(RecipeError, match="no such directory"):
        parse_recipe({"predictor": {"name": name, "path": str(tmp_path / "gone")}}, "r.yaml")


def test_a_history_line_without_a_finish_reason_is_cut_at_its_max_tokens(tmp_path):
    """HistoryRecord.cut: "without a finish reason, at max_tokens"; a line with none was read
    with the reason "None", so an output at its cap never counted as cut."""
    import json

    from batchinfer.predictors.history import read_history

    path = tmp_path / "history.jsonl"
    rows = [{"id": "a", "prompt": "x", "prompt_sha256": "1", "output_tokens": 64,
             "max_tokens": 64},
            {"id": "b", "prompt": "y", "prompt_sha256": "2", "output_tokens": 10,
             "max_tokens": 64},
            {"id": "c", "prompt": "z", "prompt_sha256": "3", "output_tokens": 64,
             "max_tokens": 64, "finish_reason": "stop"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cut = {r.id: r.cut for r in read_history([path]).records}
    assert cut == {"a": True, "b": False, "c": False}
