"""`batchinfer profile`'s QA findings at the command line: a plan where nothing can run, the
winning recipe of a --model preset, the header naming the profiled machine."""
from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from batchinfer.cli.main import app
from batchinfer.runner.recipe import load_recipe

from tests.cli.test_profile_cli import INPUT, RECIPE, _smollm_table


def _profile(*args: str):
    return CliRunner().invoke(app, ["profile", str(RECIPE), "--input", str(INPUT), *args])


def test_no_candidate_could_run_exits_2_with_each_reason_and_keeps_the_ranking(tmp_path):
    """Qwen2.5-72B on 2 x L4: every layout skipped. It exited 0 with only skipped entries in
    ranking.json; now exit 2 (the job cannot run), the reasons in the message, ranking.json
    written for inspection and no best_recipe.yaml (an earlier plan's is removed)."""
    out = tmp_path / "plan"
    out.mkdir()
    (out / "best_recipe.yaml").write_text("# an earlier plan's winner\n")
    result = _profile("--hardware", "l4", "--gpus", "2", "--model", "qwen2.5-72b", "--out",
                      str(out))
    assert result.exit_code == 2, result.output
    assert "no candidate could run" in result.output
    assert "sidp tp=1 pp=1 dp=2: parallel: tp=1 pp=1 dp=2: the weights (135.4 GiB a rank)" \
        in result.output
    ranking = json.loads((out / "ranking.json").read_text())["ranking"]
    assert ranking and all("skipped" in row and "simulated" not in row for row in ranking)
    assert not (out / "best_recipe.yaml").exists()
    result = _profile("--hardware", "l4", "--gpus", "2", "--model", "qwen2.5-72b", "--out",
                      str(out), "--json")
    assert result.exit_code == 2
    error = json.loads(result.output[result.output.index("{"):])
    assert error["exit_code"] == 2 and error["ranking"] == str(out / "ranking.json")
    assert "no candidate could run" in error["error"]


def test_a_preset_models_winning_recipe_says_the_model_must_be_set(tmp_path):
    """The plan for qwen2.5-72b kept model.path: null (it would run SmolLM2) without a word:
    no config of that model ships, so the recipe says at its top that model.path must be set."""
    result = _profile("--hardware", "h100", "--gpus", "4", "--model", "qwen2.5-72b", "--out",
                      str(tmp_path))
    assert result.exit_code == 0, result.output
    text = (tmp_path / "best_recipe.yaml").read_text()
    head = [line for line in text.splitlines() if line.startswith("#")]
    assert head[1].startswith("# SET model.path BEFORE RUNNING: this plan is for the model "
                              "preset qwen2.5-72b")
    assert load_recipe(tmp_path / "best_recipe.yaml").model.path is None


def test_a_preset_whose_config_ships_runs_it_with_dummy_weights(tmp_path):
    """qwen3-30b-a3b's config.json ships (examples/model-configs/): the recipe runs that
    model's shapes with dummy weights, and says so."""
    result = _profile("--hardware", "h100", "--gpus", "1", "--model", "qwen3-30b-a3b",
                      "--requests", "4", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    text = (tmp_path / "best_recipe.yaml").read_text()
    assert "dummy weights (random)" in text.splitlines()[1]
    recipe = load_recipe(tmp_path / "best_recipe.yaml")
    assert Path(recipe.model.path).name == "qwen3-30b-a3b"
    assert (Path(recipe.model.path) / "config.json").is_file()
    assert recipe.model.load_format == "dummy"


def test_the_header_names_the_profiled_cpu_and_the_date(tmp_path):
    """`(cpu, 2 cores)` said nothing of which CPU or when: the table's CPU model (recorded by
    the profiler) and the date it was measured follow."""
    path = _smollm_table(tmp_path / "t.json")
    table = json.loads(path.read_text())
    table["hardware"].update(cpu_model="Test CPU 9000 @ 2.0GHz",
                             measured_at="2026-11-30T23:28:18+00:00")
    path.write_text(json.dumps(table))
    result = _profile("--table", str(path), "--out", str(tmp_path / "plan"))
    assert result.exit_code == 0, result.output
    assert (f"the measured profile {path} (cpu, 2 cores, Test CPU 9000 @ 2.0GHz, measured "
            "2026-11-30)") in result.output


def test_off_a_terminal_the_progress_is_timestamped_lines(tmp_path):
    """stderr not a terminal: the rich bar printed nothing for minutes; now a timestamped line
    as `run` prints, at most every interval_s (the first at once)."""
    import io

    from batchinfer.cli.profile import _progress

    stream = io.StringIO()
    with _progress(False, stream=stream, interval_s=3600) as update:
        update("loading the model", 0, 40)
        update("1 thread(s): decode batch 1 at context 32", 1, 40)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d batchinfer profile: loading the model "
                        r"\(step 0 of 40\), elapsed 0:00:0\d", lines[0]), lines
    stream = io.StringIO()
    with _progress(False, stream=stream, interval_s=0) as update:
        for step in range(3):
            update(f"step {step}", step, 3)
    assert len(stream.getvalue().splitlines()) == 3
    stream = io.StringIO()
    with _progress(True, stream=stream, interval_s=0) as update:       # --quiet, --json
        update("loading the model", 0, 40)
    assert stream.getvalue() == ""


def test_the_command_prints_progress_lines_when_stderr_is_no_terminal(tmp_path):
    result = _profile("--table", str(_smollm_table(tmp_path / "t.json")), "--out",
                      str(tmp_path / "plan"))
    assert result.exit_code == 0, result.output
    assert re.search(r"\d\d:\d\d:\d\d batchinfer profile: reading the workload \(step 0 of 1\)",
                     result.output)


def test_profile_help_names_every_model_preset():
    from batchinfer.cli.profile import HELP
    from batchinfer.sim.model_presets import MODEL_PRESETS

    assert all(name in HELP for name in MODEL_PRESETS)


def test_an_out_that_cannot_be_a_directory_is_refused_before_anything_runs(tmp_path):
    """--out naming a file ended in a FileExistsError traceback (exit 1) after the simulations,
    and after minutes of measuring, whose table was lost with it: now exit 2 at once."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out in (afile, afile / "plan"):
        result = _profile("--hardware", "l20", "--out", str(out))
        assert result.exit_code == 2, result.output
        assert f"--out {out}:" in result.output and "Traceback" not in result.output
        result = _profile("--hardware", "l20", "--out", str(out), "--json")
        assert result.exit_code == 2
        assert json.loads(result.output[result.output.index("{"):])["exit_code"] == 2


def test_a_table_that_is_not_one_says_how_to_make_one(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = _profile("--table", str(bad), "--out", str(tmp_path / "plan"))
    assert result.exit_code == 2
    assert "--save-table" not in result.output            # no such option
    assert "batchinfer profile RECIPE --input FILE" in result.output


def test_more_ranks_than_a_cpu_tables_cores_is_refused(tmp_path):
    """--gpus 4 on a 2-core CPU table planned dp=4 as if each rank had a core of its own
    (twice the 2-rank throughput, a plan this host cannot run): refused, at most its cores."""
    table = _smollm_table(tmp_path / "t.json")
    result = _profile("--table", str(table), "--gpus", "4", "--out", str(tmp_path / "plan"))
    assert result.exit_code == 2, result.output
    assert "--gpus 4" in result.output and "at most 2" in result.output
    result = _profile("--table", str(table), "--gpus", "2", "--out", str(tmp_path / "plan"),
                      "--json")
    assert result.exit_code == 0, result.output
    assert max(r["tp"] * r["pp"] * r["dp"] for r in json.loads(result.output)["ranking"]) == 2


def test_a_history_that_is_not_there_is_named_as_the_history(tmp_path):
    result = _profile("--hardware", "l20", "--history", str(tmp_path / "nowhere"), "--out",
                      str(tmp_path / "plan"))
    assert result.exit_code == 2, result.output
    assert f"--history {tmp_path / 'nowhere'}: no such run directory" in result.output


def test_the_run_time_auto_settings_still_simulate_more_ranks_than_the_tables_cores(tmp_path):
    """The refusal is the profile command's (--gpus): a run's auto settings simulate its own
    layout on the cached table of this host, however many cores that table saw free."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.runtime.build import model_setup
    from batchinfer.sim.planner import measured_setup

    setup = measured_setup(load_recipe(RECIPE), model_setup(EngineConfig()),
                           _smollm_table(tmp_path / "t.json"), tmp_path, 4, lambda *a: None)
    assert setup.devices == 4 and setup.cores == 2
