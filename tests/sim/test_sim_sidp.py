"""SiDP in the simulator (strategies/sidp/sim.py): hand-computed WaS and CaS timelines, the KV sizing the
engine uses, the real mode switch driving rounds, and the search offering SiDP where it applies."""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.model.arch import arch_from_dict
from batchinfer.runner.recipe import StrategyParams, strategy_class
from batchinfer.engine.request import Request, SamplingParams, Sequence
from batchinfer.engine.runtime.layout import ParallelLayout
from batchinfer.engine.scheduler import MicroBatch, ScheduledSeq
from batchinfer.engine.errors import ConfigError
from batchinfer.strategies.sidp.build import sidp_num_blocks
from batchinfer.strategies.sidp.mode_switch import CAS
from batchinfer.sim.executor import VirtualClock
from batchinfer.sim.search import candidates
from batchinfer.strategies.sidp.sim import SiDPGroup
from batchinfer.sim.simulator import SimRequest, simulate

ARCH = arch_from_dict({"model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
                       "intermediate_size": 128, "num_hidden_layers": 4,
                       "num_attention_heads": 4, "num_key_value_heads": 2,
                       "max_position_embeddings": 4096})
LAYER_BYTES = 3 * 64 * 128 * 4


class SiDPCost:
    """Hand-checkable prices: a layer 1 s per token (its FFN half of it), 1 s of LM head and
    sampling when rows sample, 3 s to read a remote FFN layer, 0.25 s per p2p message."""

    num_layers = 4
    kv_bytes_per_token = ARCH.kv_bytes_per_token(4)
    logits_bytes = 4000
    memory_bytes = 8 << 30

    def __init__(self, device: str = "cpu", ffn_fixed: float = 0.0):
        self.device, self.ffn_fixed = device, ffn_fixed

    def stage_seconds(self, shape, layers, last, tp, threads, sample=True):
        return layers * 1.0 * shape.tokens + (1.0 if last and shape.sample_rows else 0.0)

    def ffn_seconds(self, tokens, threads):
        return self.ffn_fixed + 0.5 * tokens

    def weight_read_seconds(self, nbytes):
        assert nbytes == LAYER_BYTES
        return 3.0

    def p2p_seconds(self, nbytes):
        return 0.25

    def controller_seconds(self, seqs):
        return 0.0

    def transfer_seconds(self, tokens):
        return 0.25

    def host_copy_seconds(self, nbytes):
        return 0.5

    def cpu_sample_seconds(self, rows, threads=1):
        return 1.0

    def input_prep_seconds(self, shape):
        return 0.0


def _params(**overrides):
    return strategy_class("sidp").model_validate({"name": "sidp", "batch_threshold": 4,
                                                  **overrides})


def _batch(seqs: int, tag: str) -> MicroBatch:
    """`seqs` one-token prompts: `seqs` tokens, every row samples."""
    items = [ScheduledSeq(Sequence(Request(f"{tag}{i}", [1], SamplingParams(max_tokens=4))), 1)
             for i in range(seqs)]
    return MicroBatch(items, phase="prefill")


def _group(device: str = "cpu", dp: int = 2, **overrides) -> SiDPGroup:
    return SiDPGroup(_params(**overrides), ARCH, SiDPCost(device), VirtualClock(), dp, 1, 4)


def _done(group: SiDPGroup, replica: int) -> float:
    return group.executors[replica]._in_flight[-1].done_at


@pytest.mark.parametrize("device, weight_slots, expected", [
    # owners [0, 1, 0, 1]: replica 0 reads layers 1 and 3; a layer's attention 0.5 s, its FFN 0.5
    ("cpu", True, 11.0),      # each read's 3 s on the rank's cores: 4 x 1 + 2 x 3, + 1 head
    ("cpu", False, 5.0),      # in place from shared memory: 4 x 1 + 1
    # reads on their own link into 1 slot: layer 1 waits for its read (3.0 -> FFN to 3.5); the
    # read of layer 3 starts at that release and ends 6.5 -> FFN to 7.0; + 1 head
    ("cuda", True, 8.0),
    ("cuda", False, 5.0 + 2 * 2.5),   # each remote FFN streams its weights: max(0.5, 3) each
    ("cpu", None, 5.0),       # unset: in place on a (simulated) CPU host, as the engine decides
    ("cuda", None, 8.0),      # unset: the paper's slots on GPUs
])
def test_was_forward_equals_hand_computed(device, weight_slots, expected):
    group = _group(device, weight_slots=weight_slots)
    assert group.owners == [0, 1, 0, 1]
    group.run_was(0, _batch(1, "a"))
    assert _done(group, 0) == pytest.approx(expected)
    if device == "cuda" and weight_slots is not False:
        assert group.weight_wait_s == pytest.approx((3.0 - 1.5) + (6.5 - 5.0))
        # the next pass's first read started when layer 3 freed the slot (7.0): ready at 10.0
        group.run_was(0, _batch(1, "b"))
        # the second pass (from 8.0): read 2 ran 7.0-10.0, so layer 1's FFN ends 10.5; read 3
        # starts at that release and ends 13.5, layer 3's FFN 14.0; + 1 head
        assert _done(group, 0) == pytest.approx(15.0)


def test_cas_round_equals_hand_computed():
    """Replica 0 brings 2 rows, replica 1 none (a dummy that only serves layers 1 and 3).
    Per layer replica 0's attention takes 1 s; at its own layers its FFN 1 s; at replica 1's it
    sends (0.25), the owner computes (1) and returns (0.25): 2 + 2.5 + 2 + 2.5, + 1 head."""
    group = _group()
    group.run_round({0: _batch(2, "a")}, [2, 0])
    assert _done(group, 0) == pytest.approx(10.0)
    assert not group.executors[1]._in_flight                     # a dummy has no result
    assert group.executors[1].free_at == pytest.approx(8.75)     # served layer 3 until 8.75
    assert group.weight_fetches == 0


def test_without_dummy_skipping_the_idle_replica_brings_a_row_to_every_layer():
    skipping, ablation = _group(), _group(dummy_skipping=False)
    skipping.run_round({0: _batch(2, "a")}, [2, 0])
    ablation.run_round({0: _batch(2, "a")}, [2, 1])
    assert _done(ablation, 0) > _done(skipping, 0)


def test_gemm_fusion_runs_one_chain_per_layer_over_all_rows():
    """Both replicas bring 1 row; an FFN call costs 0.1 s + 0.5 s per row, so one fused call
    over 2 rows (1.1 s) beats two (1.2 s). Attention 0.4 s per layer. Fused: layer 0 ends for
    the owner at 0.65 + 1.1 = 1.75 (replica 1 has its rows at 2.0), layer 1 at 3.5 (0: 3.75),
    layer 2 at 5.25 (1: 5.5), layer 3 at 7.0 (0: 7.25); + 1 head each."""
    groups = [SiDPGroup(_params(gemm_fusion=fusion), ARCH, SiDPCost(ffn_fixed=0.1),
                        VirtualClock(), 2, 1, 4) for fusion in (True, False)]
    for group in groups:
        group.run_round({0: _batch(1, "a"), 1: _batch(1, "b")}, [1, 1])
    fused, unfused = groups
    assert (_done(fused, 0), _done(fused, 1)) == pytest.approx((8.25, 8.0))
    assert _done(unfused, 0) == pytest.approx(8.65)


def test_peak_shifting_off_makes_the_readers_of_one_owner_share_its_link():
    assert _group("cuda", dp=3).read_s == pytest.approx(3.0)
    assert _group("cuda", dp=3, peak_shifting=False).read_s == pytest.approx(6.0)
    assert _group("cuda", dp=2, peak_shifting=False).read_s == pytest.approx(3.0)


def test_the_priced_threshold_prefers_cas_while_reads_cannot_be_hidden():
    """cuda, one slot: layer 3's read starts when layer 1's FFN frees the slot, so WaS hides a
    3 s read only behind 2 x 0.5 x B of FFN; a pass costs 7, 8, 10, 16 s at B = 1, 2, 4, 8.
    CaS costs 4 x 0.5 x B + 2 x 2 x 0.25: 3, 5, 9, 17 s. B_th: the first B where WaS is no
    slower."""
    group = SiDPGroup(strategy_class("sidp").model_validate({"name": "sidp"}), ARCH,
                      SiDPCost("cuda"), VirtualClock(), 2, 1, 4)
    assert group.threshold == 8


def _config(strategy: dict, dp: int = 2, kv_tokens: int = 2048) -> EngineConfig:
    params = strategy_class(strategy["name"]).model_validate(strategy)
    return EngineConfig(model={"max_model_len": 512},
                        cache={"kv_cache_memory": kv_tokens * ARCH.kv_bytes_per_token(4)},
                        parallel={"dp": dp}, scheduler=params.scheduler_config(),
                        strategy=params)


WORKLOAD = [SimRequest(8 + (i * 37) % 120, 4 + (i * 53) % 90) for i in range(60)]


def test_simulated_sidp_sizes_kv_as_the_engine_and_switches_modes_deterministically():
    config = _config({"name": "sidp", "batch_threshold": 16, "mode_switch_patience": 2,
                      "weight_slots": True})
    runs = [simulate(config, WORKLOAD, SiDPCost(), ARCH, 512, 4, cores=2) for _ in range(2)]
    assert runs[0].to_json() == runs[1].to_json()
    result = runs[0]
    assert result.requests == len(WORKLOAD)
    assert result.output_tokens == sum(r.output_len for r in WORKLOAD)
    layout = ParallelLayout.resolve(config.parallel, ARCH)
    blocks = sidp_num_blocks(config, layout, ARCH, torch.device("cpu"), 4, [0, 1, 0, 1],
                             LAYER_BYTES, True)
    assert result.kv_capacity_tokens == 2 * blocks * config.cache.block_size > 2 * 2048
    stats = result.strategy_stats
    assert stats["mode_switches"] >= 1 and stats["cas_rounds"] > 0
    assert stats["weight_fetches"] > 0
    assert any(segment["mode"] == CAS for segment in stats["mode_timeline"])
    plain = simulate(_config({"name": "baseline", "policy": "hb"}), WORKLOAD, SiDPCost(), ARCH,
                     512, 4, cores=2)
    assert plain.kv_capacity_tokens == 2 * 2048


def test_was_only_never_runs_a_round():
    result = simulate(_config({"name": "sidp", "compute_service": False, "batch_threshold": 16}),
                      WORKLOAD, SiDPCost(), ARCH, 512, 4, cores=2)
    assert result.strategy_stats["cas_rounds"] == 0
    assert result.requests == len(WORKLOAD)


def test_sidp_layouts_and_unsimulated_strategies_are_clear_errors():
    with pytest.raises(ConfigError, match="dp >= 2"):
        simulate(_config({"name": "sidp"}, dp=1), WORKLOAD, SiDPCost(), ARCH, 512, 4)

    class OwnEngine(StrategyParams):
        name: str = "own-engine"

        def build_engine(self, config):
            raise NotImplementedError

    config = EngineConfig(model={"max_model_len": 512}, strategy=OwnEngine())
    with pytest.raises(ConfigError, match="not simulated"):
        simulate(config, WORKLOAD, SiDPCost(), ARCH, 512, 4)


def test_search_offers_sidp_at_data_parallel_layouts_only():
    recipe = strategy_class("baseline").model_validate({"name": "baseline"})
    offered = {(c.tp, c.pp, c.dp) for c in candidates(recipe, ARCH, 4)
               if c.strategy["name"] == "sidp"}
    assert offered == {(1, 1, 4)}         # tp 1, pp 1: replicas of one rank each


def test_a_bf16_model_on_cpu_prices_the_ffn_store_in_fp32_as_the_engine_builds_it():
    """A CPU table of a bf16 model records fp32 activations (activation_dtype_bytes 4): the
    engine's shared FFN store is fp32 there, so the simulated SiDP frees (and reads) fp32
    layers, and its KV per replica is the engine's, not half its extra."""
    cost = SiDPCost()
    cost.dtype_bytes = 4                       # the activations' element, weights bf16
    group = SiDPGroup(_params(), ARCH, cost, VirtualClock(), 2, 1, 2)
    assert group.layer_bytes == LAYER_BYTES and group.row_bytes == 64 * 4
    config = _config({"name": "sidp", "batch_threshold": 16})
    result = simulate(config, WORKLOAD, cost, ARCH, 512, 2, cores=2)
    layout = ParallelLayout.resolve(config.parallel, ARCH)
    blocks = sidp_num_blocks(config, layout, ARCH, torch.device("cpu"), 2, [0, 1, 0, 1],
                             LAYER_BYTES, False)
    assert result.kv_capacity_tokens == 2 * blocks * config.cache.block_size
