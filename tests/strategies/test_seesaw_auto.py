"""Seesaw's layouts left to `auto` (issue 41): chosen before the engine is built by simulating the
job's own prompts on a cost model, logged with the alternatives and recorded in the report; a
layout that cannot run is an error naming its key and what is allowed; explicit integers run as
given; `batchinfer profile` lists each alternative."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from batchinfer.engine.config import EngineConfig, ParallelConfig
from batchinfer.engine.cpu_binding import compute_threads
from batchinfer.engine.engine import Engine
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.request import SamplingParams
from batchinfer.engine.runtime.build import model_setup
from batchinfer.runner.job import EXIT_OK, JobSpec, run_job
from batchinfer.runner.recipe import Recipe, RecipeError, parse_recipe
from batchinfer.sim.auto_settings import resolve_auto_settings
from batchinfer.sim.profile_table import LinkCost, ProfileTable, RankCompute
from batchinfer.sim.search import candidates
from batchinfer.strategies.seesaw.auto_layout import decode_split, layout_search
from batchinfer.strategies.seesaw.params import SeesawParams
from tests.strategy_e2e import run_shipped_recipe

# 2 layers, 4 / 2 heads: over 2 ranks every layout is TP=2 or PP=2
TINY = {"load_format": "dummy", "max_model_len": 512, "hf_overrides": {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}}
# TP's two all-reduces a layer carry every token of a step: at 20 MB/s they swamp a prefill of
# hundreds of tokens but not a decode step; at 1 TB/s they cost nothing
SLOW_ALLREDUCE = LinkCost(1e-5, 2e7)
FAST_ALLREDUCE = LinkCost(1e-6, 1e12)


def _table(allreduce: LinkCost, num_layers: int = 2, hidden_size: int = 64,
           kv_bytes_per_token: int = 2 * 2 * 2 * 16 * 4) -> ProfileTable:
    """A machine where a layer costs ~2 ms whatever the batch up to 64 tokens (reading the
    weights), so splitting a decode batch into PP micro-batches costs one weight read each."""
    compute = {t: RankCompute([(1, 2e-3 / t), (64, 2.2e-3 / t), (2048, 1e-2 / t)], 1e-6,
                              [(1, 4e-9), (256, 1e-9)], 2e-10, [(1, 1e-4), (256, 4e-4)],
                              [(1, 1e-4), (256, 1e-3)])
               for t in (1, 2)}
    return ProfileTable({"model_id": "tiny", "num_layers": num_layers, "hidden_size": hidden_size,
                         "vocab_size": 49152, "dtype": "float32", "dtype_bytes": 4},
                        {"device": "cpu", "cores": 2}, compute, LinkCost(1e-5, 1e9), allreduce,
                        1e-5, 1e-7, kv_bytes_per_token, 8 << 30,
                        host_copy=LinkCost(1e-6, 1e10))


def _saved(table: ProfileTable, path: Path) -> str:
    table.save(path)
    return str(path)


def _recipe(costs: str, **strategy) -> Recipe:
    return Recipe(model=TINY, memory={"kv_cache_memory": "1MiB"},
                  sampling=SamplingParams(max_tokens=64, ignore_eos=True),
                  strategy={"name": "seesaw", "layout_costs": costs,
                            "cpu_kv_cache_memory": "8MiB", **strategy},
                  parallel={"pp": 2}, predictor={"name": "none"},
                  report={"refresh_seconds": 0.2, "plots": False})


def _prompts(path: Path, n: int = 48) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "word " * (50 + (i * 37) % 200)})
                            + "\n" for i in range(n)))
    return path


@pytest.mark.parametrize("allreduce,prefill,decode", [
    (SLOW_ALLREDUCE, (1, 2), (2, 1)),       # the paper's PCIe case: PP prefill, TP decode
    (FAST_ALLREDUCE, (2, 1), (2, 1))])      # NVLink-like: TP for both
def test_auto_picks_the_layouts_the_cost_model_favours(tmp_path, allreduce, prefill, decode):
    """Every (c_p, c_d) pair over the 2 ranks is simulated on the job's prompts and ranked; the
    winner moves with the hardware as the paper's analysis says it should (§3.1)."""
    recipe = _recipe(_saved(_table(allreduce), tmp_path / "t.json"), prefill_layout="auto")
    resolution = resolve_auto_settings(recipe, _prompts(tmp_path / "in.jsonl"))
    record, resolved = resolution.record, resolution.recipe
    speeds = [a["simulated_output_tok_per_s"] for a in record["alternatives"]]
    assert len(speeds) == 4 and speeds == sorted(speeds, reverse=True) and speeds[0] > speeds[-1]
    assert (resolved.parallel.tp, resolved.parallel.pp) == prefill
    assert (resolved.strategy.decode_tp, resolved.strategy.decode_pp) == decode
    assert resolved.strategy.auto_keys() == [] and resolved.strategy.prefill_layout == "parallel"
    assert record["chosen"] == {"decode_tp": decode[0], "decode_pp": decode[1],
                                "parallel": {"tp": prefill[0], "pp": prefill[1]}}
    assert record["workload"]["requests"] == 48


def test_a_run_resolves_auto_before_the_engine_is_built_and_reports_it(tmp_path, caplog):
    built = []
    engine = Engine.from_config(EngineConfig(model=TINY, cache={"kv_cache_memory": "4MiB"}))

    def factory(config):
        built.append(config)
        return engine              # a plain in-process engine runs the job

    recipe = _recipe(_saved(_table(SLOW_ALLREDUCE), tmp_path / "t.json"))
    caplog.set_level(logging.INFO, logger="batchinfer")
    out = tmp_path / "run"
    outcome = run_job(JobSpec(recipe=recipe, input_path=_prompts(tmp_path / "in.jsonl", 12),
                              output_dir=out, progress="off", limit=8, engine_factory=factory))
    assert outcome.exit_code == EXIT_OK
    config = built[0]
    assert (config.strategy.decode_tp, config.strategy.decode_pp) == (2, 1)
    assert (config.parallel.tp, config.parallel.pp) == (1, 2)    # prefill_layout: parallel
    report = json.loads((out / "report.json").read_text())
    auto = report["auto_settings"]
    assert auto["keys"] == ["decode_tp", "decode_pp"] and auto["workload"]["requests"] == 8
    assert auto["chosen"] == {"decode_tp": 2, "decode_pp": 1}
    assert [a["label"] for a in auto["alternatives"]] == ["prefill PP=2 -> decode TP=2",
                                                          "prefill PP=2 -> decode PP=2"]
    assert (report["strategy"]["decode_tp"], report["strategy"]["decode_pp"]) == (2, 1)
    assert "**Auto (decode_tp, decode_pp):** prefill PP=2 -> decode TP=2" in \
        (out / "report.md").read_text()
    logged = caplog.text
    assert "prefill PP=2 -> decode TP=2" in logged and "prefill PP=2 -> decode PP=2" in logged
    assert "<- chosen" in logged


def test_explicit_layouts_run_as_given_without_a_simulation():
    arch = model_setup(EngineConfig(model=TINY)).arch
    explicit = SeesawParams(decode_tp=2, decode_pp=1)
    assert explicit.auto_keys() == []
    assert resolve_auto_settings(Recipe(model=TINY, strategy=explicit, parallel={"pp": 2}),
                                 Path("no-such-input.jsonl")) is None
    one_given = SeesawParams(decode_tp=2)          # the ranks fix decode_pp
    assert one_given.auto_keys() == [] and decode_split(one_given, 4, arch) == (2, 2)
    assert decode_split(SeesawParams(decode_pp=2), 2, arch) == (1, 2)


def test_auto_errors_name_the_key_and_what_is_allowed(tmp_path):
    smol = model_setup(EngineConfig(model={"max_model_len": 128})).arch     # 9 / 3 heads
    allowed = r"allowed over 3 rank\(s\): decode_tp x decode_pp = 1 x 3, 3 x 1"
    with pytest.raises(ConfigError, match=r"strategy.decode_tp: 2 does not divide .*" + allowed):
        layout_search(SeesawParams(decode_tp=2, prefill_layout="auto"), ParallelConfig(pp=3),
                      smol)
    with pytest.raises(ConfigError, match="strategy.decode_pp_layers: .*" + allowed):
        layout_search(SeesawParams(decode_pp_layers=[15, 15]), ParallelConfig(pp=3), smol)
    with pytest.raises(ConfigError, match="parallel.dp"):
        layout_search(SeesawParams(), ParallelConfig(pp=3, dp=2), smol)
    for params, key in ((SeesawParams(), "strategy.decode_tp / decode_pp: auto is resolved"),
                        (SeesawParams(decode_tp=1, prefill_layout="auto"),
                         "strategy.prefill_layout: auto is resolved")):
        config = EngineConfig(model={"max_model_len": 128}, parallel={"pp": 2},
                              cache={"kv_cache_memory": "5MiB"}, strategy=params)
        with pytest.raises(ConfigError, match=key):
            Engine.from_config(config)
    prompts = _prompts(tmp_path / "in.jsonl", 4)
    with pytest.raises(ConfigError, match="strategy.layout_costs: 'nowhere.json' is neither "
                                          "measured, a hardware preset nor a profile table"):
        resolve_auto_settings(_recipe("nowhere.json"), prompts)
    other_model = _saved(_table(SLOW_ALLREDUCE, num_layers=4), tmp_path / "other.json")
    with pytest.raises(ConfigError, match="strategy.layout_costs: .*profiled for tiny"):
        resolve_auto_settings(_recipe(other_model), prompts)
    for bad in (0, "two"):
        with pytest.raises(RecipeError, match="strategy.decode_tp"):
            parse_recipe({"strategy": {"name": "seesaw", "decode_tp": bad}})


def test_a_preset_prices_the_alternatives_without_measuring(tmp_path):
    resolution = resolve_auto_settings(_recipe("a10", prefill_layout="auto"),
                                       _prompts(tmp_path / "in.jsonl", 8))
    assert resolution.record["cost_model"]["hardware"] == "a10"
    assert len(resolution.record["alternatives"]) == 4


def test_profile_lists_each_alternative_of_an_auto_recipe():
    arch = model_setup(EngineConfig(model=TINY)).arch
    seesaw = [c for c in candidates(SeesawParams(), arch, 2) if c.strategy["name"] == "seesaw"]
    ran = {(c.label, c.tp, c.pp) for c in seesaw if not c.skipped}
    assert ran == {(f"recipe (seesaw) prefill {p} -> decode {d}", tp, pp)
                   for p, tp, pp in (("PP=2", 1, 2), ("TP=2", 2, 1)) for d in ("TP=2", "PP=2")}
    assert all(c.strategy["decode_tp"] != "auto" for c in seesaw if not c.skipped)
    assert [c.dp for c in seesaw if c.skipped] == [2]       # one replica only: listed, skipped


def test_this_machines_profile_is_measured_once_and_reused(tmp_path, monkeypatch):
    """layout_costs: measured (the default) profiles the machine the first time, into the setup
    cache, and every later resolution for the same model and device reads it."""
    from batchinfer.sim import profiler

    monkeypatch.setenv("BATCHINFER_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_profile(config, threads=None, progress=None, **kw):
        # only the thread count the 2 ranks run with (the cores split between them)
        assert threads == [max(1, compute_threads(None) // 2)]
        calls.append(config.model.dtype)
        return _table(SLOW_ALLREDUCE)

    monkeypatch.setattr(profiler, "profile_machine", fake_profile)
    prompts = _prompts(tmp_path / "in.jsonl", 8)
    first = resolve_auto_settings(_recipe("measured"), prompts)
    second = resolve_auto_settings(_recipe("measured"), prompts)
    assert calls == ["auto"]
    assert first.record == {**second.record, "seconds": first.record["seconds"]}
    assert first.record["cost_model"]["hardware"] == "measured"
    assert str(tmp_path / "cache") in first.record["cost_model"]["table"]
    other = _recipe("measured")
    other.model.dtype = "float32"                   # another key: profiled again
    resolve_auto_settings(other, prompts)
    assert calls == ["auto", "float32"]


@pytest.mark.slow
def test_seesaw_recipe_runs_out_of_the_box(tmp_path, monkeypatch):
    """recipes/seesaw.yaml as shipped: SmolLM2 (the embedded default) over 3 ranks, both layouts
    left to auto. This machine's profile is stood in for by a table of SmolLM2's shape (the
    profiling itself: test_this_machines_profile_is_measured_once_and_reused); the engine runs
    the layouts the simulation chose."""
    from batchinfer.sim import profile_cache

    table = tmp_path / "smollm2.json"
    _table(SLOW_ALLREDUCE, num_layers=30, hidden_size=576,
           kv_bytes_per_token=30 * 2 * 3 * 64 * 4).save(table)
    monkeypatch.setattr(profile_cache, "cached_profile", lambda config: table)
    _, report = run_shipped_recipe("seesaw", tmp_path / "run", limit=4)
    auto = report["auto_settings"]
    assert auto["keys"] == ["decode_tp", "decode_pp", "prefill_layout"]
    assert len(auto["alternatives"]) == 4         # {PP=3, TP=3} x {PP=3, TP=3}
    chosen, ran = auto["chosen"], report["engine"]["seesaw"]
    assert ran["prefill_layout"] == chosen["parallel"]
    assert ran["decode_layout"] == {"tp": chosen["decode_tp"], "pp": chosen["decode_pp"]}
    assert "seconds_by_layout" in report["engine"]["strategy_stats"]
