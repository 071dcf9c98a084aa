"""The command line: help, --version, exit codes, validate, dry run, report."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchinfer import __version__
from batchinfer.cli.main import app

REPO = Path(__file__).resolve().parents[2]
TINY_RECIPE = """
model:
  load_format: dummy
  max_model_len: 256
  hf_overrides: {num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128,
                 num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16}
sampling: {max_tokens: 4, temperature: 0}
memory: {kv_cache_memory: 16MiB}
report: {plots: false}
"""


@pytest.fixture()
def runner():
    return CliRunner()


@pytest.fixture()
def tiny(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_RECIPE)
    return path


def _jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                            for line in lines))
    return path


def test_version(runner):
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"batchinfer {__version__}"


@pytest.mark.parametrize("module", ["batchinfer", "batchinfer.cli"])
def test_python_dash_m_runs_the_command(module):
    """`python -m batchinfer` as `batchinfer` (where the script is not on PATH)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == f"batchinfer {__version__}", \
        result.stderr


@pytest.mark.parametrize("command", ["run", "validate", "report"])
def test_help_teaches_with_an_example(runner, command):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    assert "Example" in result.output and f"batchinfer {command}" in result.output
    if command == "run":
        for code in ("0 done", "2 bad recipe", "3 the run itself failed", "130 / 143"):
            assert code in " ".join(result.output.split())


@pytest.mark.parametrize("command", ["run", "validate", "profile", "bench"])
def test_an_input_given_twice_is_refused_not_the_last_kept(runner, tmp_path, command):
    first = _jsonl(tmp_path / "a.jsonl", [{"prompt": "hi"}])
    second = _jsonl(tmp_path / "b.jsonl", [{"prompt": "bye"}])
    result = runner.invoke(app, [command, "recipes/quickstart.yaml", "--input", str(first),
                                 "-i", str(second)])
    assert result.exit_code == 2, result.output
    assert "--input given 2 times" in result.output and "a.jsonl" in result.output
    if command in ("validate", "profile"):           # --json: still one JSON object on stdout
        result = runner.invoke(app, [command, "recipes/quickstart.yaml", "--input", str(first),
                                     "-i", str(second), "--json"])
        assert result.exit_code == 2 and '"exit_code": 2' in result.output


def test_an_impossible_layout_names_the_recipe_line(runner, tmp_path):
    """Found while the engine is built, not by the recipe's schema: still the file and line."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  max_model_len: 256\nparallel:\n  pp: 64\n")
    prompts = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    for command, extra in (("validate", []), ("validate", ["--no-tokenize"]),
                           ("run", ["--dry-run"])):
        result = runner.invoke(app, [command, str(recipe), "--input", str(prompts), *extra])
        assert result.exit_code == 2, result.output
        assert f"{recipe} line 4, parallel.pp: pp=64" in result.output


@pytest.mark.parametrize("strategy", ["tdpipe", "gllm"])
def test_a_pipeline_strategy_on_one_stage_is_run_with_a_warning(runner, tmp_path, strategy):
    """TD-Pipe and gLLM work between pipeline stages: at pp 1 validate says so (a warning,
    not an error: the run schedules as asked); at pp 2 nothing is said."""
    prompts = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    for pp, warned in ((1, True), (2, False)):
        recipe = tmp_path / f"{strategy}-{pp}.yaml"
        recipe.write_text(f"model:\n  max_model_len: 256\nstrategy:\n  name: {strategy}\n"
                          f"parallel:\n  pp: {pp}\n")
        for command in (["validate", "--no-tokenize"], ["run", "--dry-run"]):
            result = runner.invoke(app, [command[0], str(recipe), "--input", str(prompts),
                                         command[1]])
            assert result.exit_code == 0, result.output
            assert (f"strategy {strategy} at parallel.pp 1: its mechanism works between "
                    "pipeline stages" in result.output) == warned, command


def test_sidp_layout_and_owner_errors_name_the_recipe_line(runner, tmp_path):
    """SiDP's refusals made while its engine would be built name the key's line too: the
    layout key that is wrong, and an item of strategy.owners."""
    prompts = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    owners = [0, 5] + [0] * 28                      # SmolLM2's 30 layers; rank 5 of 2
    cases = {"dp": ("strategy:\n  name: sidp\nparallel:\n  dp: 1\n",      # dp: line 6
                    "line 6, parallel.dp: strategy sidp shares"),
             "owners": (f"strategy:\n  name: sidp\n  owners: {owners}\nparallel:\n  dp: 2\n",
                        "line 5, strategy.owners[1] = 5: owners are data-parallel ranks 0..1")}
    for name, (text, expected) in cases.items():
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text("model:\n  max_model_len: 256\n" + text)
        result = runner.invoke(app, ["validate", str(recipe), "--input", str(prompts)])
        assert result.exit_code == 2, result.output
        assert f"{recipe} {expected}" in result.output, result.output


def test_validate_without_tokenizing_needs_no_model(runner, tmp_path):
    """--no-tokenize checks inputs on a machine without the model: its layout check is skipped
    (said), never an error."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: /nonexistent/model\nparallel:\n  pp: 64\n")
    prompts = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    result = runner.invoke(app, ["validate", str(recipe), "--input", str(prompts),
                                 "--no-tokenize"])
    assert result.exit_code == 0, result.output
    assert "1 valid" in result.output


def test_bad_recipe_exits_2_naming_the_key(runner, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("sampling:\n  temprature: 0.5\n")
    prompts = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    for command in ("run", "validate"):
        result = runner.invoke(app, [command, str(recipe), "--input", str(prompts)])
        assert result.exit_code == 2, result.output
        assert "sampling.temprature" in result.output and "did you mean 'temperature'" in result.output
        assert str(recipe) in result.output
    assert not (tmp_path / "runs").exists()


def test_validate_json_reports_a_bad_recipe_or_input_as_json(runner, tiny, tmp_path):
    """With --json, stdout is JSON on every exit: a script reading it gets the error, not text."""
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("sampling:\n  temprature: 0.5\n")
    prompts = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    for args, says in (([str(recipe), "--input", str(prompts)], "sampling.temprature"),
                       ([str(tiny), "--input", str(tmp_path)], "is a directory")):
        result = runner.invoke(app, ["validate", *args, "--json"])
        assert result.exit_code == 2, result.output
        summary = json.loads(result.stdout)
        assert says in summary["error"] and summary["exit_code"] == 2
        assert summary["recipe"] == args[0] and summary["input"] == args[2]
    ok = runner.invoke(app, ["validate", str(tiny), "--input", str(prompts), "--json"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["exit_code"] == 0, ok.output
    note = tmp_path / "tdpipe.yaml"
    note.write_text(tiny.read_text() + "strategy: {name: tdpipe}\n")
    warned = json.loads(runner.invoke(app, ["validate", str(note), "--input", str(prompts),
                                            "--json"]).stdout)
    assert any("strategy tdpipe at parallel.pp 1" in w for w in warned["warnings"])


@pytest.mark.parametrize("args, says", [
    (["validate", "r.yaml", "--json"], "Missing option '--input'"),
    (["validate", "r.yaml", "--input", "in.jsonl", "--bogus", "--json"], "No such option"),
    (["profile", "r.yaml", "--json", "--hardware"], "requires an argument")])
def test_an_arguments_error_under_json_is_json_too(monkeypatch, capsys, args, says):
    """click refuses these before the command runs; the console script still answers --json
    with one JSON object on stdout (the usage message stays on stderr)."""
    from batchinfer.cli.main import cli

    monkeypatch.setattr("sys.argv", ["batchinfer", *args])
    with pytest.raises(SystemExit) as exited:
        cli()
    assert exited.value.code == 2
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert says in summary["error"] and summary["exit_code"] == 2
    assert says in captured.err
    assert summary["recipe"] == "r.yaml"          # what was given is named, as a command's own
    assert summary["input"] == ("in.jsonl" if "--input" in args else None)


def test_impossible_layout_exits_2(runner, tmp_path):
    # SmolLM2 has 9 attention heads and 3 kv heads: tp=2 cannot split them.
    recipe = tmp_path / "tp.yaml"
    recipe.write_text("parallel: {tp: 2}\n")
    prompts = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    result = runner.invoke(app, ["run", str(recipe), "--input", str(prompts)])
    assert result.exit_code == 2, result.output
    assert "parallel.tp" in result.output and "heads" in result.output


@pytest.mark.parametrize("recipe, fragments", [
    ("parallel: {tp: 2}\n", ("parallel.tp", "heads")),
    ("parallel: {pp: 31}\n", ("parallel.pp", "30 layers")),
    ("strategy: {name: sidp}\n", ("strategy sidp", "dp >= 2")),
    ("strategy: {name: seesaw}\nparallel: {pp: 2, dp: 2}\n", ("parallel.dp", "seesaw")),
    ("strategy: {name: seesaw}\nparallel: {pp: 2}\nmemory: {enable_prefix_caching: true}\n",
     ("memory.enable_prefix_caching", "seesaw")),
    ("memory: {kv_cache_memory: 8MiB}\nmodel: {dtype: float32}\n",
     ("holds 176 tokens, less than max_model_len (8192)", "memory.kv_cache_memory")),
    ("parallel: {pp: 2}\nmemory: {kv_cache_memory: 1MiB}\nmodel: {dtype: float32, "
     "max_model_len: 2048}\n", ("holds 32 tokens per replica, less than max_model_len (2048)",
                                "memory.kv_cache_memory")),
    ("strategy: {name: seesaw, decode_tp: 1, decode_pp: 2, cpu_kv_cache_memory: 1MiB}\n"
     "parallel: {pp: 2}\nmemory: {kv_cache_memory: 16MiB}\nmodel: {max_model_len: 128}\n",
     ("strategy.cpu_kv_cache_memory", "fewer than the device cache")),
    ("model: {quantization: int8, dtype: float16}\n",
     ("model.quantization: int8 takes fp32 activations", "r.yaml line 1")),
    ("strategy: {name: sidp}\nparallel: {dp: 2}\nmodel: {quantization: int8}\n",
     ("model.quantization: strategy sidp", "int8 is not built for it")),
    ("device: {attention_backend: triton}\n", ("device.attention_backend: triton needs device "
                                               "cuda", "r.yaml line 1")),
    ("strategy: {name: tdpipe, step_times: /nonexistent/steps.json}\nparallel: {pp: 2}\n",
     ("strategy.step_times", "not a step-time table")),
    ("strategy: {name: sidp, owners: [0, 1, 5]}\nparallel: {dp: 2}\n",
     ("strategy.owners lists 3 layers; the model has 30",)),
    ("strategy: {name: seesaw, layout_costs: h999}\nparallel: {pp: 3}\n",
     ("strategy.layout_costs", "'h999' is neither measured")),
    ("strategy: {name: vllm}\nparallel: {dp: 2}\n", ("parallel.dp is 2; strategy vllm runs "
                                                    "one vLLM engine", "r.yaml line 2")),
    pytest.param("strategy: {name: vllm}\n", ("strategy vllm needs vLLM",),
                 marks=pytest.mark.skipif(__import__("importlib").util.find_spec("vllm")
                                          is not None, reason="vLLM is installed here")),
    pytest.param("device: {device: cuda}\n", ("device: cuda", "no CUDA device"),
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(),
                                          reason="a CUDA device is here")),
])
def test_validate_and_dry_run_refuse_what_the_engine_would(runner, tmp_path, recipe, fragments):
    """The engine's refusals that the model's config decides (layout against heads and layers,
    a strategy's own) come from `validate` and `run --dry-run` too, exit 2, no weights loaded
    (validate said ok and the run then refused)."""
    path = tmp_path / "r.yaml"
    path.write_text(recipe)
    prompts = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    for args in (["validate", str(path)], ["run", str(path), "--dry-run", "-o",
                                           str(tmp_path / "out")]):
        result = runner.invoke(app, args + ["--input", str(prompts)])
        assert result.exit_code == 2, result.output
        assert all(f in result.output for f in fragments), result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("recipe, says", [
    ("memory:\n  kv_cache_memory: 1KiB\n",
     "r.yaml line 2 (memory.kv_cache_memory): the KV cache holds 0 tokens"),
    ("model:\n  path: /nonexistent/model\n",
     "r.yaml line 2, model.path: '/nonexistent/model' does not exist"),
    ("model:\n  tokenizer: nope/x/y\n", "r.yaml line 2, model.tokenizer: 'nope/x/y' does not exist"),
])
def test_model_and_memory_errors_name_the_file_line_and_key(runner, tmp_path, recipe, says):
    path = tmp_path / "r.yaml"
    path.write_text(recipe)
    prompts = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    result = runner.invoke(app, ["validate", str(path), "--input", str(prompts)])
    assert result.exit_code == 2 and says in result.output, result.output


def test_validate_warns_of_weights_and_kv_this_host_cannot_hold(runner, tmp_path):
    """The build refuses weights + an explicit KV cache over the host's available memory; the
    job may run on another host (a Slurm node), so validate and --dry-run warn, exit 0."""
    path = tmp_path / "r.yaml"
    path.write_text("memory: {kv_cache_memory: 200TiB}\n")
    prompts = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    for args in (["validate", str(path)], ["run", str(path), "--dry-run", "-o",
                                           str(tmp_path / "out")]):
        result = runner.invoke(app, args + ["--input", str(prompts)])
        assert result.exit_code == 0, result.output
        assert "on this host: the model's weights take" in result.output
        assert "a run here would be refused" in result.output


def test_validate_checks_token_ids_against_the_vocabulary(runner, tiny, tmp_path):
    prompts = _jsonl(tmp_path / "in.jsonl", [{"prompt": [1, 2, 3]}, {"prompt": [5, 10 ** 9]}])
    result = runner.invoke(app, ["validate", str(tiny), "--input", str(prompts)])
    assert result.exit_code == 1, result.output
    assert "1 valid, 1 invalid" in result.output and "line 2: [bad_token_id]" in result.output


def test_missing_input_exits_2(runner, tiny, tmp_path):
    result = runner.invoke(app, ["run", str(tiny), "--input", str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 2 and "no such file" in result.output
    for command in ("run", "validate"):
        result = runner.invoke(app, [command, str(tiny), "--input", str(tmp_path)])
        assert result.exit_code == 2 and "is a directory" in result.output, result.output


def test_unknown_input_format_exits_2(runner, tiny, tmp_path):
    odd = tmp_path / "prompts.txt"
    odd.write_text("hello\n")
    result = runner.invoke(app, ["run", str(tiny), "--input", str(odd), "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and "io.input_format" in result.output


def test_bad_option_exits_2(runner, tiny):
    assert runner.invoke(app, ["run", str(tiny)]).exit_code == 2          # no --input
    assert runner.invoke(app, ["run", str(tiny), "-i", "x", "--limit", "0"]).exit_code == 2


def test_validate_reports_each_bad_line(runner, tiny, tmp_path):
    prompts = _jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "hello"}, "{oops", {"id": "b", "prompt": "x", "top_p": 3},
        {"id": "c", "prompt": "word " * 400}, {"id": "a", "prompt": "again"}])
    result = runner.invoke(app, ["validate", str(tiny), "--input", str(prompts)])
    assert result.exit_code == 1, result.output
    assert "1 valid, 4 invalid" in result.output
    for fragment in ("line 2: [invalid_json]", "line 3: [invalid_sampling]",
                     "line 4: [prompt_too_long]", "line 5: [duplicate_id]"):
        assert fragment in result.output
    as_json = runner.invoke(app, ["validate", str(tiny), "--input", str(prompts), "--json"])
    summary = json.loads(as_json.output)
    assert summary["valid"] == 1 and summary["errors_by_code"]["prompt_too_long"] == 1


@pytest.mark.parametrize("example", ["quickstart.jsonl", "quickstart_chat.jsonl",
                                     "quickstart_openai.jsonl"])
def test_examples_validate_clean(runner, example):
    result = runner.invoke(app, ["validate", str(REPO / "recipes" / "quickstart.yaml"),
                                 "--input", str(REPO / "examples" / example)])
    assert result.exit_code == 0, result.output
    assert "0 invalid" in result.output


def test_dry_run_writes_nothing(runner, tiny, tmp_path):
    prompts = _jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b"}, "nope"])
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", str(tiny), "-i", str(prompts), "-o", str(out), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "would run: 2 requests" in result.output and "invalid_json 1" in result.output
    assert not out.exists()
    from batchinfer.runner.run_dir import RunDir

    held, _ = RunDir.open(out)             # a run going on there
    try:
        result = runner.invoke(app, ["run", str(tiny), "-i", str(prompts), "-o", str(out),
                                     "--dry-run"])
    finally:
        held.close()
    assert result.exit_code == 0 and "a run is using this directory now" in result.output


def test_run_exit_codes_and_report_command(runner, tiny, tmp_path):
    prompts = _jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hello"}, "{bad",
                                             {"id": "b", "prompt": "bye", "metadata": {"m": 1}}])
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", str(tiny), "-i", str(prompts), "-o", str(out),
                                 "--progress", "off"])
    assert result.exit_code == 0, result.output
    assert "completed: 2 outputs, 1 errors" in result.output
    # the same command again resumes: nothing left, still exit 0
    again = runner.invoke(app, ["run", str(tiny), "-i", str(prompts), "-o", str(out),
                                "--progress", "off", "--fail-on-errors"])
    assert again.exit_code == 1, again.output  # --fail-on-errors counts the earlier error
    assert "this session: 0 completed, 0 failed" in again.output
    refused = runner.invoke(app, ["run", str(tiny), "-i", str(prompts), "-o", str(out),
                                  "--no-resume"])
    assert refused.exit_code == 2 and "--no-resume" in refused.output
    # a dry run of a resume with another recipe says what the run would warn
    changed = tmp_path / "changed.yaml"
    changed.write_text(tiny.read_text() + "strategy: {name: gllm}\n")
    dry = runner.invoke(app, ["run", str(changed), "-i", str(prompts), "-o", str(out),
                              "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "recipe differs" in dry.output and "strategy.name: baseline -> gllm" in dry.output
    (out / "report.md").unlink()
    report = runner.invoke(app, ["report", str(out)])
    assert report.exit_code == 0 and "## Throughput" in report.output
    assert (out / "report.md").is_file()
    assert not list(out.glob("plots/*.png"))          # the recipe's report.plots: false holds
    assert runner.invoke(app, ["report", str(tmp_path)]).exit_code == 2
    started = tmp_path / "started"           # a run that failed while setting up
    started.mkdir()
    (started / "run.json").write_text("{}")
    result = runner.invoke(app, ["report", str(started)])
    assert result.exit_code == 2 and "has written no report.json" in result.output


def test_default_run_dir_is_deterministic(runner, tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prompts = _jsonl(tmp_path / "my_prompts.jsonl", [{"prompt": "hello"}])
    result = runner.invoke(app, ["run", str(tiny), "-i", str(prompts), "--progress", "off"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "runs" / "tiny__my_prompts" / "outputs.jsonl").is_file()
