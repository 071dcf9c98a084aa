"""`batchinfer profile`'s QA findings: the number formats a measured table records, layouts whose
weights do not fit a simulated GPU, a busy host while profiling."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from batchinfer.engine.config import EngineConfig
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
