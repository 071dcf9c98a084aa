"""SiDP with its replicas on one GPU (issue 40 item 3): the FFN store in the GPU's memory, mapped by
every replica through CUDA IPC, compute-service transfers through the staged transport.

On a CUDA machine the end-to-end test runs the real thing; on a CPU host the same test runs SiDP
with every tensor of its compute service copied through host buffers (the transport's CPU test
mode, as tests/engine/test_gpu_transport.py does). The weight slots' stream ordering runs on a
GPU only.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.runtime import build as runtime_build
from batchinfer.strategies.sidp.build import check_one_gpu, resolve_weight_slots
from batchinfer.strategies.sidp.ffn_store import FFNStore, blocked_layout_available
from batchinfer.strategies.sidp.weight_slots import WeightSlots

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


def test_on_cuda_the_replicas_share_one_gpu_or_are_refused():
    with pytest.raises(ConfigError, match=r"sidp on CUDA runs its replicas on one GPU.*"
                                          r"gpu_transport: host"):
        check_one_gpu(EngineConfig(parallel={"dp": 2}), 2, visible=2)
    with pytest.raises(ConfigError, match=r"torch sees several: make one visible"):
        check_one_gpu(EngineConfig(parallel={"dp": 2, "gpu_transport": "host"}), 2, visible=2)
    check_one_gpu(EngineConfig(parallel={"dp": 2, "gpu_transport": "host"}), 2, visible=1)


def test_the_store_is_sized_before_it_is_allocated():
    for blocked in (False, True):
        store = FFNStore.allocate(2, 32, 48, torch.float32, blocked=blocked)
        assert FFNStore.bytes_per_layer(32, 48, torch.float32) == store.layer_bytes()
    assert FFNStore.bytes_per_layer(32, 48, torch.bfloat16) == 3 * 32 * 48 * 2


def test_replicas_on_one_gpu_read_the_store_in_place_and_never_blocked():
    cuda = torch.device("cuda")
    assert not resolve_weight_slots(None, cuda, one_gpu=True)
    assert resolve_weight_slots(None, cuda)             # the paper's GPUs each with its HBM
    assert resolve_weight_slots(True, cuda, one_gpu=True)
    assert not blocked_layout_available(64, 128, torch.float32, "cuda")


# --- the engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from tests.tiny_families import hf_model, save_model, tokenizer_dir

    return save_model(hf_model("llama3", num_hidden_layers=4), tmp_path_factory.mktemp("llama3"),
                      tokenizer_dir())


PROMPTS = [list(range(10 + i, 30 + 9 * i)) for i in range(6)]
MODEL = {"dtype": "float32", "max_model_len": 256}


@pytest.fixture(scope="module")
def plain_dp(tiny_llama_dir):
    """Greedy tokens of the single process, and plain DP=2's KV tokens per replica."""
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model={"path": str(tiny_llama_dir), **MODEL}, device={"device": DEVICE},
                          cache={"kv_cache_memory": "4MiB"})
    with Engine.from_config(config) as engine:
        return params, [o.output_token_ids for o in engine.generate(PROMPTS, params)]


@pytest.fixture
def staged_on_this_host(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(runtime_build, "staged_transport", lambda config, device_type: True)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [
    pytest.param({"batch_threshold": 64}, id="in-place-cas"),      # every step a CaS round
    pytest.param({"weight_slots": True, "compute_service": False}, id="slots-was"),
])
def test_sidp_on_one_device_gives_the_single_process_tokens(tiny_llama_dir, plain_dp,
                                                            staged_on_this_host, strategy):
    from batchinfer.engine.engine import Engine
    from batchinfer.strategies.sidp.params import SiDPParams

    params, expected = plain_dp
    sidp = SiDPParams(**strategy)
    config = EngineConfig(model={"path": str(tiny_llama_dir), **MODEL}, device={"device": DEVICE},
                          cache={"kv_cache_memory": "4MiB"}, strategy=sidp,
                          parallel={"dp": 2, "gpu_transport": "host", "step_timeout_seconds": 120},
                          scheduler=sidp.scheduler_config())
    with Engine.from_config(config) as engine:
        got = [o.output_token_ids for o in engine.generate(PROMPTS, params)]
        stats, info = engine.stats(), engine.info
    assert got == expected
    served = stats["strategy_stats"]
    slots = resolve_weight_slots(sidp.weight_slots, torch.device(DEVICE), one_gpu=DEVICE == "cuda")
    assert info["sidp"]["weight_slots"] is slots
    assert (served["weight_fetches"] > 0) is slots
    if sidp.compute_service:
        assert served["compute_service"]["rounds"] > 0
    assert info["sidp"]["kv_capacity_vs_plain_dp"] > 1.0     # the FFN bytes not held


# --- the weight slots on a GPU --------------------------------------------------------------------
@needs_cuda
def test_a_slot_is_refilled_only_after_the_forward_that_read_it():
    """One slot for two remote layers: the forward reads layer 1 from it behind a busy compute
    stream and releases it at once; the prefetch thread's read of layer 2 into the same slot must
    wait for that kernel (an event, no host sync), and the next acquire must see layer 2."""
    store = FFNStore.allocate(3, 16, 32, torch.float32, device=torch.device("cuda"))
    for layer in range(3):
        store.write(layer, torch.full((64, 16), float(layer), device="cuda"),
                    torch.full((16, 32), float(layer), device="cuda"))
    torch.cuda.synchronize()
    slots = WeightSlots(store, [1, 2], 1, torch.device("cuda"))
    try:
        weights = slots.acquire(1, 30.0)
        torch.cuda._sleep(100_000_000)              # the compute stream is busy for a while
        seen = weights["gate_up"].clone()           # ... then reads the slot
        slots.release(1)
        later = slots.acquire(2, 30.0)
        assert bool((later["gate_up"] == 2.0).all())
        slots.release(2)
        torch.cuda.synchronize()
    finally:
        slots.close()
    assert bool((seen == 1.0).all())


@needs_cuda
@pytest.mark.slow
def test_auto_sized_sidp_on_one_gpu_stays_inside_its_memory(tiny_llama_dir):
    """Two replicas' caches, weights and the store they map through CUDA IPC stay inside
    memory_utilization of one GPU, and take what it allows (the sizing order is checked on any
    host: test_the_cache_is_sized_before_the_store_takes_its_memory)."""
    from batchinfer.engine.engine import Engine
    from batchinfer.strategies.sidp.params import SiDPParams

    free, total = torch.cuda.mem_get_info()
    sidp = SiDPParams()
    config = EngineConfig(model={"path": str(tiny_llama_dir), **MODEL}, device={"device": "cuda"},
                          cache={"memory_utilization": 0.3}, strategy=sidp,
                          parallel={"dp": 2, "gpu_transport": "host"},
                          scheduler=sidp.scheduler_config())
    with Engine.from_config(config) as engine:
        left, _ = torch.cuda.mem_get_info()
        ratio = engine.info["sidp"]["kv_capacity_vs_plain_dp"]
    assert ratio > 1.0
    assert free - left <= 0.3 * free + (2 << 30)     # the workers' CUDA contexts beside it
    assert free - left >= 0.2 * free                 # ... and the caches took what they were given


@pytest.mark.slow
def test_the_cache_is_sized_before_the_store_takes_its_memory(monkeypatch, tiny_llama_dir):
    """The store commits its bytes when allocated (host shared memory, or the GPU): sized after
    it, the KV would count them twice (gone from the free memory, and again as the FFN a replica
    no longer holds). Here the free memory drops by the store's bytes when it is allocated."""
    from pathlib import Path as _Path

    from batchinfer.engine import build as engine_build
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.model.loader import load_arch
    from batchinfer.engine.runtime.layout import ParallelLayout
    from batchinfer.strategies.sidp.build import sidp_num_blocks
    from batchinfer.strategies.sidp.ownership import resolve_owners
    from batchinfer.strategies.sidp.params import SiDPParams

    free = {"bytes": 2 << 30}
    monkeypatch.setattr(engine_build, "available_memory", lambda device: free["bytes"])
    allocate = FFNStore.allocate.__func__

    def allocating(cls, *args, **kwargs):
        store = allocate(cls, *args, **kwargs)
        free["bytes"] -= store.layer_bytes() * store.gate_up.shape[0]
        return store

    monkeypatch.setattr(FFNStore, "allocate", classmethod(allocating))
    sidp = SiDPParams(weight_slots=False)
    config = EngineConfig(model={"path": str(tiny_llama_dir), **MODEL}, strategy=sidp,
                          parallel={"dp": 2}, scheduler=sidp.scheduler_config())
    arch = load_arch(_Path(tiny_llama_dir))
    layout = ParallelLayout.resolve(config.parallel, arch)
    expected = sidp_num_blocks(config, layout, arch, torch.device("cpu"), 4,
                               resolve_owners(None, arch.num_layers, 2),
                               FFNStore.bytes_per_layer(arch.hidden_size, arch.intermediate_size,
                                                        torch.float32),
                               False, available=2 << 30)
    with Engine.from_config(config) as engine:
        tokens = engine.info["sidp"]["kv_tokens_per_replica"]
    assert free["bytes"] < 2 << 30                       # the store was allocated ...
    assert tokens == expected * config.cache.block_size  # ... after the cache was sized
