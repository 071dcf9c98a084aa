"""`batchinfer profile`'s QA findings: the number formats a measured table records, layouts whose
weights do not fit a simulated GPU, a busy host while profiling."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.errors import ConfigError
from batchinfer.sim.profile_table import ProfileTable


def _tiny(tiny_engine_config, model=None, cache=None) -> dict:
    return {"model": {**tiny_engine_config["model"], **(model or {})},
            "cache": {**tiny_engine_config["cache"], **(cache or {})}}


@pytest.mark.parametrize("model, cache, dtype, kv_dtype", [
    ({"dtype": "bfloat16"}, {}, "bfloat16", "bfloat16"),
    ({"dtype": "float32"}, {"kv_cache_dtype": "bfloat16"}, "float32", "bfloat16"),
    ({"dtype": "float32"}, {}, "float32", "float32"),
])
def test_the_table_records_the_formats_the_engine_runs(make_engine, tiny_engine_config, model,
                                                       cache, dtype, kv_dtype):
    """A bf16 model on a CPU keeps fp32 activations (the first parameter is fp32): the table
    recorded float32 and twice the KV bytes a run has. It records the engine's own formats."""
    from batchinfer.sim.profiler import model_record

    sections = _tiny(tiny_engine_config, model, cache)
    engine = make_engine(**sections)
    try:
        record, kv_per_token = model_record(engine, EngineConfig(**sections))
    finally:
        engine.close()
    kv_bytes = {"bfloat16": 2, "float32": 4}[kv_dtype]
    arch = engine.replicas[0].executor.model.arch
    assert (record["dtype"], record["dtype_bytes"]) == (dtype, {"bfloat16": 2, "float32": 4}[dtype])
    assert (record["kv_cache_dtype"], record["kv_element_bytes"]) == (kv_dtype, kv_bytes)
    assert kv_per_token == arch.kv_bytes_per_token(kv_bytes)
    assert record["activation_dtype_bytes"] == 4          # hidden states: fp32 on a CPU


def _table(model: dict, device: str = "cpu") -> ProfileTable:
    from batchinfer.sim.profile_table import LinkCost, RankCompute

    compute = {1: RankCompute([(1, 1e-3)], 0.0, [(1, 1e-7)], 0.0, [(1, 1e-3)], [(1, 1e-4)])}
    return ProfileTable({"model_id": "m", "num_layers": 4, "hidden_size": 64, "vocab_size": 1000,
                         **model}, {"device": device, "cores": 2}, compute, LinkCost(1e-4, 1e9),
                        LinkCost(1e-4, 1e9), 0.0, 0.0, 1, 8 << 30)


def test_old_and_new_tables_size_weights_and_kv_in_the_format_run():
    """A table the fixed profiler wrote: its dtype. One from before it (no kv_cache_dtype) on a
    CPU: the recipe's model as this machine resolves it (its float32 said nothing); transfers
    keep the activations' element either way."""
    from batchinfer.sim.cost_model import MeasuredCostModel
    from batchinfer.sim.planner import table_dtype_bytes

    model = SimpleNamespace(dtype_bytes=2)
    new = _table({"dtype": "bfloat16", "dtype_bytes": 2, "kv_cache_dtype": "bfloat16",
                  "kv_element_bytes": 2, "activation_dtype_bytes": 4})
    old = _table({"dtype": "float32", "dtype_bytes": 4})
    assert table_dtype_bytes(new, SimpleNamespace(dtype_bytes=4)) == 2
    assert table_dtype_bytes(old, model) == 2
    assert table_dtype_bytes(_table({"dtype": "bfloat16", "dtype_bytes": 2}, "cuda"),
                             SimpleNamespace(dtype_bytes=4)) == 2
    assert MeasuredCostModel(new).dtype_bytes == 4 == MeasuredCostModel(old).dtype_bytes


def _plan(tmp_path, kv: str, hardware: str, gpus: int, model: str):
    from batchinfer.runner.recipe import load_recipe
    from batchinfer.sim.planner import plan

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {max_model_len: 512}\nsampling: {temperature: 0, max_tokens: 8}\n"
                      "strategy: {name: baseline, max_num_seqs: 16}\n"
                      + (f"memory: {{kv_cache_memory: {kv}}}\n" if kv else ""))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"prompt": "question {i} about the weather"}}\n'
                               for i in range(8)))
    return plan(load_recipe(recipe), prompts, tmp_path / "out", hardware, gpus, None, model, 8)


@pytest.mark.parametrize("kv", ["64MiB", None])
def test_layouts_whose_weights_do_not_fit_the_gpu_are_skipped_with_that_reason(tmp_path, kv):
    """Qwen2.5-72B (145 GB of bf16 weights) on 2 x L4: with an explicit KV the planner ranked
    SiDP dp=2 first (173,168 KV tokens); without one every layout 'left 0 KV tokens'. Every
    strategy's layout (SiDP's included) is skipped because its weights do not fit."""
    result = _plan(tmp_path, kv, "l4", 2, "qwen2.5-72b")
    assert result.best_recipe is None and result.ranked
    labels = {c.label for c in result.ranked}
    assert {"sidp", "baseline-sb", "tdpipe"} <= labels
    for cand in result.ranked:
        assert cand.result is None
        assert "do not fit the GPU's" in cand.skipped, cand.skipped
        share = 135.4 / (cand.tp * cand.pp)
        assert f"the weights ({share:.1f} GiB a rank)" in cand.skipped
        assert ("memory.kv_cache_memory 0.06 GiB" in cand.skipped) == (kv is not None)


def test_a_layout_whose_weights_fit_still_runs_beside_one_that_does_not(tmp_path):
    """Llama2-13B (24 GiB of weights) on 4 x L4: one replica per GPU does not fit, TP=4 does."""
    result = _plan(tmp_path, "1GiB", "l4", 4, "llama2-13b")
    by_layout = {(c.label, c.tp, c.pp, c.dp): c for c in result.ranked}
    assert "do not fit the GPU's" in by_layout["baseline-sb", 1, 1, 4].skipped
    assert "do not fit the GPU's" in by_layout["sidp", 1, 1, 4].skipped
    assert by_layout["baseline-sb", 4, 1, 1].result is not None
    assert result.best_recipe is not None and result.ranked[0].tp * result.ranked[0].pp >= 2


def test_a_profile_on_a_busy_host_warns_once_before_measuring(monkeypatch, caplog):
    """`run` warned of CPUs other processes keep busy; the profile measured on silently and
    recorded the slowdown as the machine's speed. It warns, once, from the same measurement."""
    from batchinfer.engine import cpu_load
    from batchinfer.engine.cpu_binding import allowed_cpus
    from batchinfer.sim import profiler

    cpus = allowed_cpus()
    monkeypatch.setenv("BATCHINFER_CPU_BUSY_CHECK", "1")
    monkeypatch.setattr(cpu_load, "_measured", {})
    monkeypatch.setattr(cpu_load, "_warned", set())
    monkeypatch.setattr(profiler, "_warned_busy", set())
    monkeypatch.setattr(cpu_load, "cpu_busy_fractions",
                        lambda cpus, *args, **kwargs: {cpu: 1.0 for cpu in cpus})

    class Measured(Exception):
        pass

    def stop(config):
        raise Measured

    monkeypatch.setattr(profiler.Engine, "from_config", staticmethod(stop))
    for _ in range(2):
        with pytest.raises(Measured):
            profiler.profile_machine(EngineConfig(), quick=True)
    warned = [r.getMessage() for r in caplog.records if "this profile may use" in r.getMessage()]
    assert len(warned) == 1
    assert warned[0].startswith(f"CPU(s) {cpus[0]} (100%)")
    assert "records the slowdown as its speed" in warned[0]


def test_an_idle_host_or_the_check_off_gives_no_warning(monkeypatch, caplog):
    from batchinfer.engine import cpu_load
    from batchinfer.sim import profiler

    monkeypatch.setattr(profiler, "_warned_busy", set())
    monkeypatch.setattr(cpu_load, "_measured", {})
    monkeypatch.setattr(cpu_load, "cpu_busy_fractions",
                        lambda cpus, *args, **kwargs: {cpu: 0.0 for cpu in cpus})
    monkeypatch.setenv("BATCHINFER_CPU_BUSY_CHECK", "1")
    profiler.warn_if_host_busy()
    monkeypatch.setattr(cpu_load, "_measured", {})
    monkeypatch.setattr(cpu_load, "cpu_busy_fractions",
                        lambda cpus, *args, **kwargs: {cpu: 1.0 for cpu in cpus})
    monkeypatch.setenv("BATCHINFER_CPU_BUSY_CHECK", "0")
    profiler.warn_if_host_busy()
    assert not [r for r in caplog.records if "this profile may use" in r.getMessage()]


def test_a_measured_gpu_tables_memory_is_already_net_of_working_memory():
    """A measured GPU table's memory is the room its run had for weights + KV (after the working
    memory and the unused share); only a preset's is the whole card. A layout that fits that room
    is not refused for working memory counted twice."""
    from batchinfer.engine.config import ParallelConfig
    from batchinfer.engine.model.arch import arch_from_dict
    from batchinfer.engine.runtime.layout import ParallelLayout
    from batchinfer.sim.simulator import check_rank_memory

    arch = arch_from_dict({"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096,
                           "num_hidden_layers": 8, "num_attention_heads": 16,
                           "num_key_value_heads": 4, "vocab_size": 32000})
    layout = ParallelLayout.resolve(ParallelConfig(), arch)
    weights = arch.num_params() * 2
    config = EngineConfig(cache={"kv_cache_memory": 1 << 30})
    measured = SimpleNamespace(device="cuda", memory_bytes=weights + (1 << 30) + (1 << 20),
                               memory_is_card=False)
    check_rank_memory(config, layout, arch, measured, 2)
    # a KV asked past the measured room may still fit the card: the engine decides
    check_rank_memory(EngineConfig(cache={"kv_cache_memory": 4 << 30}), layout, arch, measured, 2)
    card = SimpleNamespace(**{**vars(measured), "memory_is_card": True})
    with pytest.raises(ConfigError, match="working memory"):
        check_rank_memory(config, layout, arch, card, 2)
    small = SimpleNamespace(**{**vars(measured), "memory_bytes": weights // 2})
    with pytest.raises(ConfigError, match="do not fit the .* GiB the measured GPU had"):
        check_rank_memory(config, layout, arch, small, 2)
