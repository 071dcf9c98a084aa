"""`batchinfer profile`: ranking, the winning recipe, a reused table, presets, clear errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchinfer.cli.main import app
from batchinfer.runner.recipe import load_recipe
from batchinfer.sim.profile_table import LinkCost, ProfileTable, RankCompute

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "quickstart.yaml"
INPUT = REPO / "examples" / "quickstart.jsonl"


def _smollm_table(path: Path) -> Path:
    """A table with SmolLM2-135M's shape (what a profile of the embedded default records)."""
    compute = {t: RankCompute([(1, 1e-3 / t), (64, 5e-3 / t), (2048, 0.14 / t)], 1e-6,
                              [(1, 3e-7), (64, 1.4e-7)], 3e-8, [(1, 6e-3 / t), (256, 0.15 / t)], [(1, 2e-4), (256, 3e-3)])
               for t in (1, 2)}
    table = ProfileTable({"model_id": "SmolLM2-135M-Instruct", "num_layers": 30,
                          "hidden_size": 576, "vocab_size": 49152, "dtype": "float32",
                          "dtype_bytes": 4}, {"device": "cpu", "cores": 2}, compute,
                         LinkCost(1e-4, 4e9), LinkCost(2e-4, 1.5e9), 3.5e-4, 0.0, 46080, 16 << 30)
    table.save(path)
    return path


def test_profile_with_a_saved_table_ranks_and_writes_the_winner(tmp_path):
    out = tmp_path / "plan"
    result = CliRunner().invoke(app, ["profile", str(RECIPE), "--input", str(INPUT), "--table",
                                      str(_smollm_table(tmp_path / "t.json")), "--out", str(out),
                                      "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["simulated"] is True
    ranked = [r for r in report["ranking"] if "simulated" in r]
    speeds = [r["simulated"]["output_tok_per_s"] for r in ranked]
    assert speeds == sorted(speeds, reverse=True) and speeds[0] > 0
    layouts = {(r["tp"], r["pp"], r["dp"]) for r in report["ranking"]}
    assert {(1, 1, 1), (1, 2, 1), (1, 1, 2)} <= layouts
    # SmolLM2's 9 heads do not split by 2: no TP=2 candidate
    assert all(r["tp"] == 1 for r in report["ranking"])
    assert report["workload"]["requests"] == sum(1 for line in INPUT.open() if line.strip())
    best = load_recipe(out / "best_recipe.yaml")
    top = ranked[0]
    assert (best.parallel.tp, best.parallel.pp, best.parallel.dp) == (top["tp"], top["pp"],
                                                                      top["dp"])
    assert best.strategy.name == top["strategy"]["name"]
    assert best.sampling == load_recipe(RECIPE).sampling       # the rest of the recipe is kept
    assert json.loads((out / "ranking.json").read_text())["ranking"] == report["ranking"]


def test_profile_on_a_preset_plans_for_a_paper_model(tmp_path):
    result = CliRunner().invoke(app, ["profile", str(RECIPE), "--input", str(INPUT),
                                      "--hardware", "l20", "--gpus", "4", "--model",
                                      "llama2-13b", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["cost_model"]["hardware"] == "l20"
    layouts = {(r["tp"], r["pp"], r["dp"]) for r in report["ranking"]}
    assert (4, 1, 1) in layouts and (1, 4, 1) in layouts and (2, 2, 1) in layouts
    assert any(r["label"] == "tdpipe" and "simulated" in r for r in report["ranking"])


def test_an_unknown_preset_is_refused_before_anything_is_measured(tmp_path):
    result = CliRunner().invoke(app, ["profile", str(RECIPE), "--input", str(INPUT),
                                      "--hardware", "h999", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "--hardware: unknown hardware preset 'h999'; known: a10" in result.output
    assert not any(tmp_path.iterdir())               # nothing measured or written


def test_the_rendered_table_is_whole_off_a_terminal_and_counts_kv_per_replica(tmp_path):
    """Piped (CliRunner's output is no terminal) the numbers are not cut to 80 columns, the
    header names the profile table (it said "this machine" for any --table), and KV/replica is
    one replica's (it printed the sum over dp replicas)."""
    table = _smollm_table(tmp_path / "t.json")
    args = ["profile", str(RECIPE), "--input", str(INPUT), "--table", str(table)]
    report = json.loads(CliRunner().invoke(app, args + ["--out", str(tmp_path / "a"),
                                                        "--json"]).output)
    text = CliRunner().invoke(app, args + ["--out", str(tmp_path / "b")]).output
    assert "\u2026" not in text and f"measured profile {table}" in text
    totals = {r["simulated"]["kv_capacity_tokens"] for r in report["ranking"]
              if r["dp"] == 2 and "simulated" in r}
    cells = [[c.strip() for c in line.split("\u2502")[1:-1]] for line in text.splitlines()
             if line.count("\u2502") == 11]
    shown = {int(c[7].replace(",", "")) for c in cells if c[4] == "2"}
    assert totals and shown == {total // 2 for total in totals}


def test_profile_renders_a_table(tmp_path):
    result = CliRunner().invoke(app, ["profile", str(RECIPE), "--input", str(INPUT),
                                      "--hardware", "a100-pcie", "--gpus", "2", "--model",
                                      "qwen2.5-14b", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "simulated" in result.output.lower() and "winning recipe" in result.output


@pytest.mark.parametrize("args, message", [
    (["--hardware", "tpu-v9"], "unknown hardware preset 'tpu-v9'; known: a10"),
    (["--hardware", "l20", "--model", "gpt-5"], "unknown model preset 'gpt-5'"),
    (["--hardware", "l20", "--table", "x.json"], "--table is a measured profile"),
    (["--model", "llama2-13b"], "--model names a preset model"),
])
def test_profile_usage_errors_exit_2_with_the_reason(tmp_path, args, message):
    result = CliRunner().invoke(app, ["profile", str(RECIPE), "--input", str(INPUT), "--out",
                                      str(tmp_path), *args])
    assert result.exit_code == 2
    assert message in result.output


def test_an_int8_recipe_plans_from_another_machines_table_on_a_cpu_without_vnni(tmp_path,
                                                                                monkeypatch):
    """The table's step times were measured elsewhere, so this CPU's instructions do not matter;
    the table's own quantization must match the recipe's."""
    import yaml

    from batchinfer.engine.model import int8_linear

    monkeypatch.setattr(int8_linear, "cpu_identity",
                        lambda: ("AVX2 Test CPU", frozenset({"avx2", "fma"})))
    data = yaml.safe_load(RECIPE.read_text())
    data["model"]["quantization"] = "int8"
    recipe = tmp_path / "int8.yaml"
    recipe.write_text(yaml.safe_dump(data))
    plain = _smollm_table(tmp_path / "fp32.json")
    table = json.loads(plain.read_text())
    table["model"].update(quantization="int8", quantize_lm_head=False)
    int8_table = tmp_path / "int8.json"
    int8_table.write_text(json.dumps(table))

    def profile(table_path):
        return CliRunner().invoke(app, ["profile", str(recipe), "--input", str(INPUT), "--table",
                                        str(table_path), "--out", str(tmp_path / "plan"),
                                        "--json"])

    result = profile(int8_table)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["ranking"][0]["simulated"]["output_tok_per_s"] > 0
    assert "quantization: int8" in (tmp_path / "plan" / "best_recipe.yaml").read_text()
    result = profile(plain)
    assert result.exit_code == 2
    assert "profiled with model.quantization empty" in result.output
    assert "the recipe asks for int8" in result.output


def test_a_table_that_is_not_one_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    result = CliRunner().invoke(app, ["profile", str(RECIPE), "--input", str(INPUT), "--table",
                                      str(bad), "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "not a batchinfer profile table" in result.output


def test_the_workload_takes_output_lengths_from_history_or_the_predictor(tmp_path):
    """Input lengths as a run tokenizes them; output lengths drawn from earlier runs' history,
    or (predictor none) each request's max_tokens; malformed lines are counted and left out."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.runtime.build import model_setup
    from batchinfer.predictors.history import history_record
    from batchinfer.sim.workload import load_workload

    from batchinfer.runner.recipe import PredictorConfig

    auto = load_recipe(RECIPE)
    recipe = auto.model_copy(update={"predictor": PredictorConfig(name="none")})
    tokenizer = model_setup(EngineConfig()).tokenizer
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Hello there", "max_tokens": 7}\n'
                       'not json\n'
                       '{"id": "b", "prompt": "Write a poem about the sea."}\n')
    plain = load_workload(recipe, prompts, tokenizer, 2048)
    assert [r.output_len for r in plain.requests] == [7, recipe.sampling.max_tokens]
    # auto under a recipe whose strategy reads no forecast: the job's replies are still the
    # predictor's to estimate (the embedded model's shipped one), not max_tokens
    assert not auto.strategy.reads_length_forecasts() and auto.predictor.name == "auto"
    estimated = load_workload(auto, prompts, tokenizer, 2048, max_requests=2)
    assert "shipped" in estimated.source and estimated.requests[0].output_len <= 7
    assert plain.requests[0].prompt_len == len(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}]))       # the recipe's chat_template: always
    assert sum(plain.skipped.values()) == 1 and plain.lines_read == 3
    history = tmp_path / "history.jsonl"
    history.write_text("".join(json.dumps(history_record(f"h{i}", "x", 3, n, "length", None, 500))
                               + "\n" for i, n in enumerate((40, 41, 42))))
    drawn = load_workload(recipe, prompts, tokenizer, 2048, history=[history])
    assert drawn.source.startswith("history")
    # drawn from the history, capped by each request's max_tokens (7 for "a")
    assert drawn.requests[0].output_len == 7 and drawn.requests[1].output_len in (40, 41, 42)
