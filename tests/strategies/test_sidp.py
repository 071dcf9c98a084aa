"""SiDP's Weight-as-a-Service parts: ownership and the peak-shifted prefetch order, the shared FFN
store, and the weight slots under a forward loop with random delays."""
from __future__ import annotations

import random
import time

import pytest
import torch

from batchinfer.engine.request import SamplingParams
from batchinfer.strategies.sidp.build import resolve_weight_slots
from batchinfer.strategies.sidp.ffn_store import FFNStore
from batchinfer.strategies.sidp.ownership import (default_owners, prefetch_order, resolve_owners,
                                       slots_needed)
from batchinfer.strategies.sidp.weight_slots import WeightSlots


@pytest.mark.parametrize("num_layers,dp", [(30, 2), (30, 4), (7, 3), (8, 8), (5, 1)])
def test_peak_shifting_covers_every_non_owner_layer_once_per_cycle(num_layers, dp):
    owners = default_owners(num_layers, dp)
    for rank in range(dp):
        order = prefetch_order(rank, owners, dp)
        assert sorted(order) == [l for l in range(num_layers) if owners[l] != rank]
        cycles = [layer // dp for layer in order]             # a cycle's reads are done
        assert cycles == sorted(cycles)                       # before the next cycle's start
        assert slots_needed(rank, owners, dp) <= max(dp - 1, 0)
    if dp > 1 and num_layers >= dp:           # at a cycle's start the ranks read different layers
        firsts = []
        for rank in range(dp):
            order = prefetch_order(rank, owners, dp)
            firsts.append(next(l for l in order if l < dp))
        assert len(set(firsts)) == dp
        unshifted = {prefetch_order(r, owners, dp, peak_shifting=False)[0] for r in range(1, dp)}
        assert unshifted == {0}                 # without it every non-owner starts at layer 0


def test_owner_maps_are_checked():
    assert resolve_owners(None, 4, 2) == [0, 1, 0, 1]
    assert resolve_owners([1, 1, 0, 0], 4, 2) == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="lists 3 layers; the model has 4"):
        resolve_owners([0, 1, 0], 4, 2)
    with pytest.raises(ValueError, match=r"owners\[2\] = 5: owners are data-parallel ranks 0..1"):
        resolve_owners([0, 1, 5, 0], 4, 2)
    assert slots_needed(0, [1, 1, 0, 0], 2) == 2   # a lopsided map needs more slots


def _store(num_layers: int) -> FFNStore:
    store = FFNStore.allocate(num_layers, hidden=8, intermediate=12, dtype=torch.float32)
    for layer in range(num_layers):
        store.write(layer, torch.full((24, 8), float(layer)), torch.full((8, 12), -float(layer)))
    return store


@pytest.mark.parametrize("dp,rank", [(2, 1), (4, 2), (3, 0)])
def test_slots_hold_the_right_layer_and_never_leak(dp, rank):
    """A forward loop over 6 passes with random delays on both sides: every acquired slot holds
    its layer's weights, every remote layer is fetched once per pass, and at the end every slot
    is free again."""
    num_layers, rng = 13, random.Random(dp * 10 + rank)
    store = _store(num_layers)
    owners = default_owners(num_layers, dp)
    order = prefetch_order(rank, owners, dp)
    slow_store = _SlowStore(store, rng)
    slots = WeightSlots(slow_store, order, slots_needed(rank, owners, dp), torch.device("cpu"))
    try:
        for _ in range(6):
            for layer in range(num_layers):
                if owners[layer] == rank:
                    weights = store.view(layer)
                else:
                    weights = slots.acquire(layer, timeout_s=10)
                time.sleep(rng.random() * 0.001)
                assert torch.all(weights["gate_up"] == layer)
                assert torch.all(weights["down"] == -layer)
                if owners[layer] != rank:
                    slots.release(layer)
        deadline = time.monotonic() + 5
        while slots.occupancy()[1] < len(slots.slots) and time.monotonic() < deadline:
            time.sleep(0.01)              # the thread fills the freed slots for the next pass
    finally:
        slots.close()
    free, ready, in_use = slots.occupancy()
    assert in_use == 0 and free + ready == len(slots.slots)
    remote = len(order)
    assert 6 * remote <= slots.stats.fetches <= 6 * remote + len(slots.slots)
    assert slots.stats.hits + slots.stats.waits == 6 * remote


class _SlowStore:
    """The store, with a random delay on every remote read."""

    def __init__(self, store: FFNStore, rng: random.Random):
        self.store, self.rng, self.gate_up = store, rng, store.gate_up

    def layer_shapes(self):
        return self.store.layer_shapes()

    def layer_bytes(self):
        return self.store.layer_bytes()

    def read_into(self, layer, slot):
        time.sleep(self.rng.random() * 0.002)
        self.store.read_into(layer, slot)


def test_a_failed_read_reaches_the_forward():
    class Broken(_SlowStore):
        def read_into(self, layer, slot):
            raise OSError("owner went away")

    store = _store(4)
    slots = WeightSlots(Broken(store, random.Random(0)), [1, 3], 1, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="owner went away"):
        slots.acquire(1, timeout_s=10)
    slots.close()


# --- end to end ------------------------------------------------------------------------------------
E2E = ["Hi", "The capital of France is", "Write a haiku about the sea. " * 6,
       "List three prime numbers:", "1, 2, 3,"]


E2E_PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
E2E_BASE = {"cache": {"kv_cache_memory": "32MiB"}, "model": {"max_model_len": 512}}


@pytest.fixture(scope="module")
def plain_dp():
    """Plain DP=2's greedy tokens and KV capacity, once for every SiDP variant below."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHINFER_LINEAR_KERNEL", "torch")
        with Engine.from_config(EngineConfig(**E2E_BASE, parallel={"dp": 2})) as engine:
            tokens = [o.output_token_ids for o in engine.generate(E2E, E2E_PARAMS)]
            return tokens, engine.stats()["kv_capacity_tokens"]


@pytest.mark.parametrize("strategy", [{"weight_slots": True},
                                      {"weight_slots": True, "peak_shifting": False,
                                       "owners": [1] * 20 + [0] * 10},
                                      {"weight_slots": False}, {}])
@pytest.mark.slow
def test_sidp_greedy_outputs_equal_plain_dp(make_engine, monkeypatch, plain_dp, strategy):
    """SmolLM2, DP=2: the same greedy tokens as plain DP (both with plain torch linears: oneDNN's
    packed GEMM rounds differently), a larger KV cache at the same per-replica budget, and every
    remote layer read through the slots where there are slots (in place: no copies)."""
    from batchinfer.strategies.sidp.params import SiDPParams

    monkeypatch.setenv("BATCHINFER_LINEAR_KERNEL", "torch")
    expected, plain = plain_dp
    sidp = SiDPParams(**strategy)
    with make_engine(**E2E_BASE, parallel={"dp": 2}, strategy=sidp,
                     scheduler=sidp.scheduler_config()) as engine:
        got = [o.output_token_ids for o in engine.generate(E2E, E2E_PARAMS)]
        stats = engine.stats()
    assert got == expected
    assert stats["kv_capacity_tokens"] > 2 * plain
    assert stats["sidp"]["plain_dp_kv_tokens_per_replica"] * 2 == plain
    slots = stats["strategy_stats"]
    with_slots = resolve_weight_slots(strategy.get("weight_slots"), torch.device("cpu"))
    assert stats["sidp"]["weight_slots"] == with_slots
    if with_slots:
        assert slots["weight_fetches"] > 0 and slots["weight_slot_hit_ratio"] is not None
    else:                                    # in place: no copies, no slots
        assert slots["weight_fetches"] == 0 and stats["sidp"]["weight_slots_per_rank"] == [0, 0]


def test_weight_slots_default_to_where_a_remote_read_is_slower(monkeypatch):
    from batchinfer.strategies.sidp import build

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(build, "numa_nodes", lambda: 1)
    assert not resolve_weight_slots(None, cpu) and resolve_weight_slots(None, cuda)
    assert resolve_weight_slots(True, cpu) and not resolve_weight_slots(False, cuda)
    monkeypatch.setattr(build, "numa_nodes", lambda: 2)
    assert resolve_weight_slots(None, cpu)


def test_sidp_layouts_and_owner_maps_are_checked(make_engine):
    from batchinfer.engine.errors import ConfigError
    from batchinfer.strategies.sidp.params import SiDPParams

    with pytest.raises(ConfigError, match=r"needs tp: 1, pp: 1, dp >= 2 \(got tp: 1, pp: 2"):
        make_engine(**E2E_BASE, parallel={"pp": 2, "dp": 2}, strategy=SiDPParams())
    with pytest.raises(ConfigError, match="strategy.owners lists 2 layers; the model has 30"):
        make_engine(**E2E_BASE, parallel={"dp": 2}, strategy=SiDPParams(owners=[0, 1]))


@pytest.mark.slow
def test_sidp_recipe_runs_out_of_the_box(tmp_path):
    from batchinfer.engine.model.loader import load_arch
    from batchinfer.engine.model.sources import resolve_model_dir
    from batchinfer.strategies.sidp.ffn_store import blocked_layout_available
    from tests.strategy_e2e import run_shipped_recipe

    _, report = run_shipped_recipe("sidp", tmp_path / "run", limit=4)
    assert report["strategy"]["name"] == "sidp"
    assert report["engine"]["sidp"]["kv_capacity_vs_plain_dp"] > 1.0
    with_slots = resolve_weight_slots(None, torch.device("cpu"))   # the recipe leaves it unset
    assert report["engine"]["sidp"]["weight_slots"] == with_slots
    assert (report["engine"]["strategy_stats"]["weight_fetches"] > 0) == with_slots
    arch = load_arch(resolve_model_dir(None)[0])
    if blocked_layout_available(arch.hidden_size, arch.intermediate_size, torch.float32):
        assert report["engine"]["sidp"]["ffn_layout"] == "blocked"   # through its kernel


@pytest.mark.slow
def test_sidp_swapping_under_memory_pressure_gives_the_recomputing_tokens(make_engine):
    """memory.preemption_mode swap on SiDP (DP=2, each replica its own swap area): requests that
    need more KV than both replicas hold swap out and back and get the tokens the same job gets
    recomputing, with no prompt prefilled twice. A 4-layer dummy model with a narrow FFN: SiDP
    gives each replica the FFN weights' memory as KV, which for SmolLM2 outgrows any small job.
    Its hidden size is 64 (1 KiB of KV a token): SmolLM2's 576 spent most of the time in the
    vocabulary head for nothing the test is about; the cache is cut with it, so ~1,700 tokens fit
    (about a dozen preemptions a run, asserted below)."""
    from batchinfer.strategies.sidp.params import SiDPParams
    from tests.strategy_e2e import E2E_PROMPTS

    sidp = SiDPParams()
    model = {"load_format": "dummy", "max_model_len": 512,
             "hf_overrides": {"num_hidden_layers": 4, "intermediate_size": 128, "hidden_size": 64,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}}
    params = [SamplingParams(max_tokens=150 + 10 * i, temperature=0.0, ignore_eos=True)
              for i in range(len(E2E_PROMPTS))]
    runs = {}
    for mode in ("recompute", "swap"):
        cache = {"kv_cache_memory": "680KiB", "preemption_mode": mode, "swap_space": "32MiB"}
        with make_engine(model=model, cache=cache, parallel={"dp": 2}, strategy=sidp,
                         scheduler=sidp.scheduler_config()) as engine:
            outs = engine.generate(E2E_PROMPTS, params)
            prompt_tokens = sum(len(engine.tokenizer.encode(p)) for p in E2E_PROMPTS)
            runs[mode] = ([o.output_token_ids for o in outs], engine.stats(),
                          engine.info["preemption_mode"])
    (recomputed, plain, _), (swapped, stats, mode) = runs["recompute"], runs["swap"]
    assert plain["num_preemptions"] > 0 and plain["computed_prefill_tokens"] > prompt_tokens
    assert len({tuple(o[:8]) for o in recomputed}) >= 5      # the replies depend on their prompts
    assert mode == "swap" and swapped == recomputed
    assert stats["kv_swap"]["swap_outs"] == stats["num_preemptions"] > 0
    assert stats["kv_swap"]["swap_ins"] == stats["kv_swap"]["swap_outs"]
    assert stats["computed_prefill_tokens"] == prompt_tokens


# --- the blocked layout (its kernel: tests/kernels/test_fast_linear.py) ------------------------
def test_a_blocked_store_gives_the_plain_stores_ffn():
    from batchinfer.engine.kernels import load_native_kernels
    from batchinfer.engine.model.ops import TorchOps
    from batchinfer.strategies.sidp.compute_service import ffn

    if not load_native_kernels():
        pytest.skip("native CPU kernels unavailable")
    plain = FFNStore.allocate(2, 32, 48, torch.float32)
    blocked = FFNStore.allocate(2, 32, 48, torch.float32, blocked=True)
    assert blocked.blocked and not plain.blocked and blocked.layer_bytes() == plain.layer_bytes()
    gen = torch.Generator().manual_seed(0)
    for layer in range(2):
        gate_up, down = torch.randn(96, 32, generator=gen), torch.randn(32, 48, generator=gen)
        plain.write(layer, gate_up, down)
        blocked.write(layer, gate_up, down)
    x = torch.randn(5, 32, generator=gen)
    for layer in range(2):
        torch.testing.assert_close(ffn(x, blocked.view(layer), TorchOps),
                                   ffn(x, plain.view(layer), TorchOps), rtol=1e-5, atol=1e-4)


def test_a_model_sidp_cannot_run_is_left_out_of_profile_and_refused_naming_what_to_run():
    """SiDP's store holds SiLU-gated MLPs: Gemma's GeGLU is not a profile candidate (its winning
    recipe would be refused), and validate / the build name the gate and the strategies that run
    it, as for a mixture of experts."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.errors import ConfigError
    from batchinfer.sim.search import candidates
    from batchinfer.strategies.base import BaselineStrategy
    from batchinfer.strategies.sidp.params import SiDPParams
    from tests.tiny_families import tiny_arch

    def names(arch):
        return {c.strategy["name"] for c in candidates(BaselineStrategy(), arch, 2)}

    assert "sidp" in names(tiny_arch("llama3"))
    for family in ("gemma2", "gemma3", "mixtral"):
        assert "sidp" not in names(tiny_arch(family)) and "baseline" in names(tiny_arch(family))
    config = EngineConfig(parallel={"dp": 2})
    with pytest.raises(ConfigError, match=r"\(gemma2\) gates with gelu_pytorch_tanh: run it with "
                                          r"another strategy \(baseline, "):
        SiDPParams().check_config(config, tiny_arch("gemma2"))
    with pytest.raises(ConfigError, match=r"\(mixtral\) has a mixture of experts: run it with"):
        SiDPParams().check_config(config, tiny_arch("mixtral"))
