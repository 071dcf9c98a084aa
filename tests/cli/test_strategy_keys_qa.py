"""Strategy keys a recipe gives that the job would not honour: `validate` and `run --dry-run`
refuse them, naming the key, instead of a run that ignores them (or refuses them after the
model loads)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from batchinfer.cli.main import app


@pytest.mark.parametrize("recipe, fragments", [
    # accepted by sipipe / sidp (the baseline's batching knobs) and silently ignored
    ("strategy: {name: sipipe, async_scheduling: true}\nparallel: {pp: 2}\n",
     ("strategy.async_scheduling: true needs one process", "worker processes")),
    ("strategy: {name: sidp, async_scheduling: true}\nparallel: {dp: 2}\n",
     ("strategy.async_scheduling: true needs one process",)),
    # validate said ok and the run refused
    ("strategy: {name: baseline, async_scheduling: true}\nparallel: {pp: 2}\n",
     ("strategy.async_scheduling: true needs one process",)),
])
def test_validate_and_dry_run_refuse_keys_the_job_would_not_honour(tmp_path, recipe, fragments):
    path = tmp_path / "r.yaml"
    path.write_text(recipe)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    runner = CliRunner()
    for args in (["validate", str(path)],
                 ["run", str(path), "--dry-run", "-o", str(tmp_path / "out")]):
        result = runner.invoke(app, args + ["--input", str(prompts)])
        assert result.exit_code == 2, result.output
        assert all(f in result.output for f in fragments), result.output


def test_async_scheduling_where_it_runs_still_validates(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("strategy: {name: baseline, async_scheduling: false}\nparallel: {pp: 2}\n")
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    result = CliRunner().invoke(app, ["validate", str(path), "--input", str(prompts)])
    assert result.exit_code == 0, result.output
