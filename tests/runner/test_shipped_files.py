"""The README's recipes/ and examples/ paths, typed where there is no such folder (a wheel
install run from a job directory), name the copy batchinfer ships instead of only "no such
file"."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchinfer.cli.main import app
from batchinfer.runner.io.inputs import input_file_problem
from batchinfer.runner.recipe import load_recipe
from batchinfer.runner.recipe_errors import RecipeError
from batchinfer.runner.shipped_files import missing_file_problem, shipped


def test_the_shipped_folders_hold_the_readme_files():
    assert shipped("recipes/quickstart.yaml").is_file()
    assert shipped("examples/quickstart.jsonl").is_file()
    assert (shipped("examples/model-configs") / "qwen3-30b-a3b" / "config.json").is_file()


def test_a_missing_readme_recipe_names_the_shipped_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as caught:
        load_recipe("recipes/quickstart.yaml")
    assert str(shipped("recipes/quickstart.yaml")) in str(caught.value)
    assert f"cp -r {shipped('recipes')} ." in str(caught.value)


def test_a_missing_readme_input_names_the_shipped_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    problem = input_file_problem(Path("examples/quickstart.jsonl"))
    assert problem.startswith("no such file")
    assert str(shipped("examples/quickstart.jsonl")) in problem


@pytest.mark.parametrize("path", ["recipes/no-such-recipe.yaml", "my/recipes/quickstart.yaml",
                                  "quickstart.yaml", "recipes"])
def test_other_missing_files_are_plainly_missing(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    assert missing_file_problem(path) == "no such file"
    assert missing_file_problem(tmp_path / path) == "no such file"


def test_the_quickstart_command_outside_a_checkout_says_where_the_recipe_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "recipes/quickstart.yaml", "--input",
                                      "examples/quickstart.jsonl"])
    assert result.exit_code == 2
    assert str(shipped("recipes/quickstart.yaml")) in result.output


def test_the_docs_predictor_commands_outside_a_checkout_name_the_shipped_copies(tmp_path,
                                                                               monkeypatch):
    """docs/engine.md's `predictor eval predictors/shipped/... --history examples/...` where
    those folders are not (a wheel install): the error names batchinfer's own copies, first the
    predictor's, then (given it) the history's."""
    from batchinfer.runner.shipped_files import missing_dir_problem

    monkeypatch.chdir(tmp_path)
    predictor = "predictors/shipped/smollm2-135m-instruct"
    result = CliRunner().invoke(app, ["predictor", "eval", predictor,
                                      "--history", "examples/predictor_history"])
    assert result.exit_code == 2 and str(shipped(predictor)) in "".join(result.output.split())
    result = CliRunner().invoke(app, ["predictor", "eval", str(shipped(predictor)),
                                      "--history", "examples/predictor_history"])
    assert result.exit_code == 2
    assert str(shipped("examples/predictor_history")) in "".join(result.output.split())
    assert missing_dir_problem("predictors/shipped/no-such") is None
    assert missing_dir_problem("runs/mine") is None
