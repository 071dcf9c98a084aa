"""The simulator (sim/): a hand-computed pipeline timeline, end-to-end runs of the real schedulers
on simulated executors, determinism, the cost fit and the profile table's round trips."""
from __future__ import annotations

import pytest

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.model.arch import arch_from_dict
from batchinfer.runner.recipe import strategy_class
from batchinfer.engine.request import Request, SamplingParams, Sequence
from batchinfer.engine.runtime.build import num_kv_blocks
from batchinfer.engine.runtime.layout import ParallelLayout
from batchinfer.engine.scheduler import MicroBatch, ScheduledSeq
from batchinfer.sim.cost_model import BatchShape, MeasuredCostModel
from batchinfer.sim.executor import FILLER_TOKEN, SimulatedExecutor, VirtualClock
from batchinfer.sim.profile_fit import fit_rank_compute
from batchinfer.sim.profile_table import LinkCost, ProfileTable, RankCompute
from batchinfer.sim.simulator import SimRequest, kv_blocks, simulate

ARCH_CONFIG = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 4096}
ARCH = arch_from_dict(ARCH_CONFIG)


class LinearCost:
    """Hand-checkable prices: 0.5 s per token per layer, 1 s of sampling when a row samples
    (on the last stage, or on a CPU sampler), 0.25 s per stage hand-off, 0.1 s of controller work
    per step, 0.5 s per host copy."""

    num_layers = 4
    kv_bytes_per_token = ARCH.kv_bytes_per_token(4)
    logits_bytes = 4000
    device, memory_bytes = "cpu", 8 << 30

    def stage_seconds(self, shape, layers, last, tp, threads, sample=True):
        return layers * 0.5 * shape.tokens + (1.0 if last and shape.sample_rows and sample
                                              else 0.0)

    def cpu_sample_seconds(self, rows, threads=1):
        return 1.0

    def input_prep_seconds(self, shape):
        return 0.0

    def transfer_seconds(self, tokens):
        return 0.25

    def controller_seconds(self, seqs):
        return 0.1

    def host_copy_seconds(self, nbytes):
        return 0.5



def _prefill(prompt_len: int, rid: str) -> MicroBatch:
    seq = Sequence(Request(rid, [1] * prompt_len, SamplingParams(max_tokens=4)))
    return MicroBatch([ScheduledSeq(seq, prompt_len)], phase="prefill")


def test_two_stage_timeline_equals_hand_computed():
    clock = VirtualClock()
    executor = SimulatedExecutor(clock, LinearCost(), [2, 2])
    a, b = _prefill(4, "a"), _prefill(2, "b")
    executor.submit(a)     # controller 0.1; stage 0 [0.1, 4.1]; +0.25; stage 1 [4.35, 9.35]
    executor.submit(b)     # controller 0.2; stage 0 [4.1, 6.1]; stage 1 waits: [9.35, 12.35]
    assert not executor.ready()
    executor.wait()
    assert clock.now == pytest.approx(9.35)
    batch, result = executor.collect()
    assert batch is a and result.tokens == [FILLER_TOKEN]
    assert not executor.ready()
    executor.wait()
    assert clock.now == pytest.approx(12.35)
    spans = [(e["mb_id"], e["stage"], e["start"], e["end"]) for e in executor.timeline()]
    expected = [(0, 0, 0.1, 4.1), (0, 1, 4.35, 9.35), (1, 0, 4.1, 6.1), (1, 1, 9.35, 12.35)]
    assert spans == [pytest.approx(s) for s in expected]
    summary = executor.stage_summary()
    assert summary["window_s"] == pytest.approx(12.25)
    assert [s["bubble_ratio"] for s in summary["stages"]] == pytest.approx(
        [1 - 6 / 12.25, 1 - 8 / 12.25])


def _spans(executor) -> list[tuple]:
    return [(e["mb_id"], e["stage"], e["start"], e["end"]) for e in executor.timeline()]


def _drain(executor, clock) -> list[float]:
    """Completion times, in order."""
    done = []
    while executor.num_in_flight:
        while not executor.ready():
            executor.wait()
        executor.collect()
        done.append(clock.now)
    return done


def test_sipipe_cpu_samplers_take_sampling_off_the_last_stage():
    """Sampling leaves the last stage for CPU sampler lanes (micro-batch n on lane n mod 2):
    a: stage 1 [4.35, 8.35], logits copy 0.5, lane 0 [8.85, 9.85]; b: stage 1 [8.35, 10.35],
    lane 1 [10.85, 11.85] (on the stage it would end at 12.35)."""
    clock = VirtualClock()
    executor = SimulatedExecutor(clock, LinearCost(), [2, 2], cpu_samplers=2)
    executor.submit(_prefill(4, "a"))
    executor.submit(_prefill(2, "b"))
    assert _spans(executor) == [pytest.approx(s) for s in [
        (0, 0, 0.1, 4.1), (0, 1, 4.35, 8.35), (1, 0, 4.1, 6.1), (1, 1, 8.35, 10.35)]]
    assert _drain(executor, clock) == pytest.approx([9.85, 11.85])


class RowCost(LinearCost):
    def cpu_sample_seconds(self, rows, threads=1):
        return rows / threads


def _one_token_prompts(rows: int) -> MicroBatch:
    items = []
    for i in range(rows):
        seq = Sequence(Request(f"d{i}", [1], SamplingParams(max_tokens=4)))
        items.append(ScheduledSeq(seq, 1))
    return MicroBatch(items, phase="prefill")


@pytest.mark.parametrize("split,lanes,threads,sampled", [
    (False, 2, 1, 5.0), (True, 2, 1, 3.0), (True, 3, 1, 2.0), (True, 2, 2, 1.5)])
def test_a_split_pool_samples_a_micro_batch_on_every_lane(split, lanes, threads, sampled):
    """5 rows (stage 1 ends at 0.1 + 5 x 0.5 x 2 + 0.25 + 5 = 10.35, the logits copy 0.5): on one
    lane 5 rows; split, the largest share (3 of 5 on two lanes, 2 on three) over its threads."""
    clock = VirtualClock()
    executor = SimulatedExecutor(clock, RowCost(), [2, 2], cpu_samplers=lanes,
                                 sampler_threads=threads, split_samples=split)
    executor.submit(_one_token_prompts(5))
    assert _drain(executor, clock) == [pytest.approx(10.85 + sampled)]


def test_structure_unaware_hand_offs_send_metadata_and_block_the_sender():
    """Two more messages per hand-off (0.25 s each) and stage 0 waits until stage 1 takes
    its activations: b's stage 0 is free only at 9.85, when stage 1 starts it."""
    clock = VirtualClock()
    executor = SimulatedExecutor(clock, LinearCost(), [2, 2], structure_aware=False)
    executor.submit(_prefill(4, "a"))
    executor.submit(_prefill(2, "b"))
    executor.submit(_prefill(2, "c"))
    spans = _spans(executor)
    assert spans[:4] == [pytest.approx(s) for s in [
        (0, 0, 0.1, 4.1), (0, 1, 4.85, 9.85), (1, 0, 4.85, 6.85), (1, 1, 9.85, 12.85)]]
    assert spans[4] == pytest.approx((2, 0, 9.85, 11.85))


def _config(strategy: dict, pp: int = 1, dp: int = 1, kv_bytes: int = 1 << 20) -> EngineConfig:
    params = strategy_class(strategy["name"]).model_validate(strategy)
    return EngineConfig(model={"max_model_len": 512}, cache={"kv_cache_memory": kv_bytes},
                        parallel={"pp": pp, "dp": dp}, scheduler=params.scheduler_config(),
                        strategy=params)


def test_single_request_end_to_end_equals_hand_computed():
    """One request, 4 prompt tokens, 3 outputs, one stage of 4 layers: a prefill step
    (0.1 + 8 + 1) then two decode steps (0.1 + 2 + 1 each)."""
    config = _config({"name": "baseline", "policy": "sb"})
    result = simulate(config, [SimRequest(4, 3)], LinearCost(), ARCH, 512, 4)
    assert result.elapsed_s == pytest.approx(9.1 + 2 * 3.1)
    assert result.output_tokens == 3 and result.steps == 3
    assert result.output_tok_per_s == pytest.approx(3 / 15.3, rel=1e-3)


def _table() -> ProfileTable:
    compute = {t: RankCompute([(1, 1e-4 / t), (64, 4e-4 / t), (2048, 1e-2 / t)], 2e-6,
                              [(1, 4e-9), (256, 1e-9)], 2e-10, [(1, 1e-3), (256, 4e-3)], [(1, 1e-4), (256, 1e-3)])
               for t in (1, 2)}
    return ProfileTable({"model_id": "test", "num_layers": 4, "hidden_size": 64,
                         "vocab_size": 1000, "dtype": "float32", "dtype_bytes": 4},
                        {"device": "cpu", "cores": 2}, compute, LinkCost(1e-4, 1e9),
                        LinkCost(2e-4, 5e8), 1e-4, 1e-6, ARCH.kv_bytes_per_token(4), 8 << 30,
                        host_copy=LinkCost(1e-5, 1e10))


WORKLOAD = [SimRequest(8 + (i * 37) % 120, 4 + (i * 53) % 90, 4 + (i * 53) % 90)
            for i in range(80)]
SIMULATED = {
    "single-hb": ({"name": "baseline", "policy": "hb"}, 1, 1),
    "pp2-sb": ({"name": "baseline", "policy": "sb"}, 2, 1),
    "tdpipe": ({"name": "tdpipe", "step_times": None}, 2, 1),
    "gllm": ({"name": "gllm"}, 2, 1),
    "dp2-hb": ({"name": "baseline", "policy": "hb"}, 1, 2),
    "sipipe": ({"name": "sipipe"}, 2, 1),
}


@pytest.mark.parametrize("name", sorted(SIMULATED))
def test_simulation_is_deterministic_and_runs_every_request(name):
    strategy, pp, dp = SIMULATED[name]
    cost = MeasuredCostModel(_table())
    # a KV cache that binds: 4,096 tokens per replica
    runs = [simulate(_config(strategy, pp, dp, kv_bytes=4096 * cost.kv_bytes_per_token // pp),
                     WORKLOAD, cost, ARCH, 512, 4, cores=2).to_json() for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0]["requests"] == len(WORKLOAD) and runs[0]["failed"] == 0
    assert runs[0]["output_tokens"] == sum(r.output_len for r in WORKLOAD)
    assert runs[0]["pp"] == pp and runs[0]["dp"] == dp
    assert set(runs[0]["bubble_ratio_by_stage"]) == {str(s) for s in range(pp)}


def test_seesaw_switches_layouts_and_moves_kv_in_the_simulator():
    """PP=2 prefill, TP=2 decode, a CPU store: the real Seesaw scheduler drives re-shards and
    copies on the simulated executor, deterministically, and every request finishes."""
    config = _config({"name": "seesaw", "decode_tp": 2, "cpu_kv_cache_memory": "3MiB"}, pp=2,
                     kv_bytes=1024 * ARCH.kv_bytes_per_token(4) // 2)
    runs = [simulate(config, WORKLOAD, MeasuredCostModel(_table()), ARCH, 512, 4, cores=2)
            for _ in range(2)]
    assert runs[0].to_json() == runs[1].to_json()
    result = runs[0]
    assert result.requests == len(WORKLOAD)
    assert result.output_tokens == sum(r.output_len for r in WORKLOAD)
    stats = result.strategy_stats
    assert stats["num_reshards"] >= 2 and stats["num_switches"] >= 2
    assert stats["swapped_out_tokens"] > 0 and stats["swapped_in_tokens"] > 0
    assert stats["reshard_seconds"] > 0 and stats["copy_seconds"] > 0


def test_tdpipe_profiles_its_step_times_on_the_simulated_executor():
    cost = MeasuredCostModel(_table())
    from batchinfer.sim.simulator import simulated_engine

    engine = simulated_engine(_config({"name": "tdpipe"}, pp=2), cost, ARCH, 512, 4, cores=2)
    table = engine.scheduler.step_times
    assert table is not None
    # a decode micro-batch in steady state costs its slower stage (stage times from the model)
    assert table.decode_time(1) > 0 and table.decode_time(256) > table.decode_time(1)


def test_kv_blocks_match_the_engine():
    config = _config({"name": "baseline", "policy": "hb"}, pp=2, kv_bytes=3 << 20)
    layout = ParallelLayout.resolve(config.parallel, ARCH)
    import torch

    assert kv_blocks(config, layout, ARCH, LinearCost(), 4, 512) == num_kv_blocks(
        config, layout, ARCH, torch.device("cpu"), 4)


def test_impossible_layouts_are_clear_errors():
    with pytest.raises(ConfigError, match="parallel.pp"):
        simulate(_config({"name": "baseline"}, pp=8), WORKLOAD, LinearCost(), ARCH, 512, 4)
    with pytest.raises(ConfigError, match="max_model_len"):
        simulate(_config({"name": "baseline"}, kv_bytes=1024), WORKLOAD, LinearCost(), ARCH,
                 512, 4)


def test_batch_shape_counts_decode_context_and_prefill_pairs():
    prefill = _prefill(4, "p")
    seq = Sequence(Request("d", [1] * 10, SamplingParams(max_tokens=4)))
    seq.output_token_ids.append(5)
    seq.num_computed_tokens = 10
    batch = MicroBatch(prefill.items + [ScheduledSeq(seq, 1)])
    shape = BatchShape.of(batch)
    assert (shape.tokens, shape.seqs, shape.decode_seqs, shape.decode_context,
            shape.sample_rows) == (5, 2, 1, 11, 2)
    assert shape.prefill_pairs == pytest.approx(4 * 2.5)


def test_fit_recovers_a_known_cost_model():
    truth = RankCompute([(1, 2e-4), (16, 3e-4), (256, 2e-3), (2048, 1.5e-2)], 5e-6,
                        [(1, 6e-9), (16, 3e-9), (256, 2e-9)], 3e-10, [(1, 1e-3)], [(1, 1e-4)])
    points = []
    for size in (1, 16, 256):
        for context in (32, 512):
            points.append({"tokens": size, "seqs": size, "decode_seqs": size,
                           "decode_context": size * (context + 1), "prefill_pairs": 0.0})
    for tokens, prompts in ((16, [16]), (256, [256]), (2048, [256] * 8), (2048, [2048])):
        points.append({"tokens": tokens, "seqs": len(prompts), "decode_seqs": 0,
                       "decode_context": 0,
                       "prefill_pairs": sum(n * (n + 1) / 2 for n in prompts)})
    for p in points:
        p["seconds"] = 30 * truth.layer_seconds(p["tokens"], p["seqs"], p["decode_seqs"],
                                                p["decode_context"], p["prefill_pairs"])
    fitted = fit_rank_compute(points, 30, [(1, 1e-3)], [(1, 1e-4)])
    for p in fitted.points:
        assert p["fitted_seconds"] == pytest.approx(p["seconds"], rel=1e-3)
    assert fitted.attn_decode == [pytest.approx(p, rel=1e-2) for p in truth.attn_decode]
    assert [y for _, y in fitted.layer_dense] == sorted(y for _, y in fitted.layer_dense)


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_profile_table_round_trips(tmp_path, suffix):
    table = _table()
    table.compute[1].points.append({"kind": "decode", "tokens": 1, "seconds": 0.01})
    path = tmp_path / f"profile{suffix}"
    table.save(path)
    assert ProfileTable.load(path).to_json() == table.to_json()


def test_a_table_of_another_version_is_refused(tmp_path):
    import json

    data = _table().to_json()
    data["version"] = 99
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="version 99"):
        ProfileTable.load(path)


def test_unprofiled_thread_counts_scale_from_the_nearest_below():
    table = _table()
    four = table.rank_compute(4)
    assert four.layer_dense[0][1] == pytest.approx(table.compute[2].layer_dense[0][1] / 2)


@pytest.mark.slow
def test_a_quick_real_profile_round_trips(tmp_path):
    """The profiler on the embedded model (coarse settings): every section filled, the fit's
    prediction beside each measured point, and the saved table loads back equal."""
    from batchinfer.sim.profiler import profile_machine

    table = profile_machine(EngineConfig(), threads=[1], quick=True)
    compute = table.compute[1]
    assert compute.points and all(p["seconds"] > 0 and p["fitted_seconds"] > 0
                                  for p in compute.points)
    assert table.p2p.bytes_per_s > 0 and table.allreduce.bytes_per_s > 0
    assert table.kv_bytes_per_token == 46080 and table.memory_available_bytes > 0
    from batchinfer.engine.host_cpu import cpu_identity

    assert table.hardware.get("cpu_model") == (cpu_identity()[0] or None)
    for suffix in (".json", ".csv"):
        path = tmp_path / f"table{suffix}"
        table.save(path)
        assert ProfileTable.load(path).to_json() == table.to_json()


def test_a_windowed_model_releases_blocks_in_the_simulator_as_in_the_engine():
    """Every layer with a 32-key window: long sequences hold their window, not their context,
    so a cache that preempts them with freeing off runs them without preemption."""
    from dataclasses import replace

    windowed = replace(ARCH, layer_windows=(32,) * ARCH.num_layers)
    work = [SimRequest(200, 100) for _ in range(8)]
    kv_bytes = 40 * 16 * windowed.kv_bytes_per_token(4)            # 40 blocks of 16 tokens
    runs = {}
    for free in (True, False):
        config = _config({"name": "baseline", "policy": "hb"}, kv_bytes=kv_bytes)
        config = config.model_copy(update={"cache": config.cache.model_copy(
            update={"free_outside_window": free})})
        runs[free] = simulate(config, work, LinearCost(), windowed, 512, 4)
    assert runs[True].output_tokens == runs[False].output_tokens == 800
    assert runs[False].preemptions > 0 and runs[True].preemptions == 0


@pytest.mark.parametrize("pp", [1, 2])
def test_swapping_is_simulated_as_copies_instead_of_recomputed_prompts(pp):
    """memory.preemption_mode swap in the simulator: the scheduler's swaps ride on the next
    micro-batch and each stage pays the host copy before its forward; nothing is recomputed."""
    work = [SimRequest(200, 100) for _ in range(8)]
    kv_bytes = 40 * 16 * ARCH.kv_bytes_per_token(4) // pp          # 40 blocks of 16 tokens
    runs = {}
    for mode in ("recompute", "swap"):
        config = _config({"name": "baseline", "policy": "hb"}, pp=pp, kv_bytes=kv_bytes)
        config = config.model_copy(update={"cache": config.cache.model_copy(
            update={"preemption_mode": mode, "swap_space": "64MiB"})})
        runs[mode] = simulate(config, work, LinearCost(), ARCH, 512, 4)
    assert runs["recompute"].output_tokens == runs["swap"].output_tokens == 800
    assert runs["recompute"].preemptions > 0 and not runs["recompute"].kv_swap
    swap = runs["swap"].kv_swap
    assert swap["swap_outs"] == runs["swap"].preemptions > 0 and swap["swap_ins"] == swap["swap_outs"]
    # a copy here costs 0.5 s a stage; recomputing a 200-token prompt costs it its prefill
    assert runs["swap"].elapsed_s < runs["recompute"].elapsed_s


@pytest.mark.parametrize("pp, groups", [(1, (0, 32, 32, 32, 32, 32)), (2, (0, 32, 32, 32))])
def test_a_hybrid_window_model_runs_layer_groups_in_the_simulator_as_in_the_engine(pp, groups):
    """Gemma 3's pattern on 6 layers (5 windowed of 32 keys, then a global one): the simulator
    takes the engine's layout (at PP=2 split 3 + 3, by stage: each windowed group a layer of each
    stage, 4 groups instead of 6), sizes the pool in its pages and releases the windowed groups'
    blocks, so eight 400-token sequences in 48 blocks of every layer preempt each other less and
    finish sooner than over one table of every layer (1 / 4 preemptions against 10 / 13 at PP=1
    / 2, 0.67x / 0.64x the time)."""
    from dataclasses import replace

    from batchinfer.engine.group_blocks import GroupedBlockManager
    from batchinfer.sim.simulator import simulated_engine

    hybrid = arch_from_dict({**ARCH_CONFIG, "num_hidden_layers": 6})
    hybrid = replace(hybrid, layer_windows=(32,) * 5 + (0,))
    work = [SimRequest(100, 300) for _ in range(8)]
    kv_bytes = 48 * 16 * hybrid.kv_bytes_per_token(4)             # 48 blocks of every layer
    runs = {}
    for free in (True, False):
        config = _config({"name": "baseline", "policy": "hb"}, pp=pp, kv_bytes=kv_bytes // pp)
        config = config.model_copy(update={
            "cache": config.cache.model_copy(update={"free_outside_window": free}),
            "parallel": config.parallel.model_copy(update={"pp_layers": [3, 3] if pp == 2
                                                            else None})})
        manager = simulated_engine(config, LinearCost(), hybrid, 512, 4).replicas[0] \
            .scheduler.block_manager
        assert isinstance(manager, GroupedBlockManager) == free
        if free:
            assert manager.windows == groups
        runs[free] = simulate(config, work, LinearCost(), hybrid, 512, 4)
    assert runs[True].output_tokens == runs[False].output_tokens == 2400
    assert runs[True].preemptions < runs[False].preemptions
    assert runs[True].elapsed_s < 0.85 * runs[False].elapsed_s


def test_seesaw_runs_the_layer_groups_in_the_simulator():
    """Gemma 3's pattern on 6 layers under Seesaw (PP=2 prefill split 3 + 3, TP=2 decode): both
    simulated tiers run the stage layout's 4 groups and the copies move pages, so with the same
    device and store bytes as one table of every layer more of the eight 400-token sequences
    decode on the device at once: fewer go back to the store, fewer copies, sooner done."""
    from dataclasses import replace

    from batchinfer.engine.group_blocks import GroupedBlockManager
    from batchinfer.sim.simulator import simulated_engine

    hybrid = replace(arch_from_dict({**ARCH_CONFIG, "num_hidden_layers": 6}),
                     layer_windows=(32,) * 5 + (0,))
    work = [SimRequest(100, 300) for _ in range(8)]
    token = hybrid.kv_bytes_per_token(4)
    runs = {}
    for free in (True, False):
        config = _config({"name": "seesaw", "decode_tp": 2,
                          "cpu_kv_cache_memory": 100 * 16 * token},
                         pp=2, kv_bytes=48 * 16 * token // 2)
        config = config.model_copy(update={
            "cache": config.cache.model_copy(update={"free_outside_window": free}),
            "parallel": config.parallel.model_copy(update={"pp_layers": [3, 3]})})
        scheduler = simulated_engine(config, LinearCost(), hybrid, 512, 4).replicas[0].scheduler
        for manager in (scheduler.block_manager, scheduler.tiers.store):
            assert isinstance(manager, GroupedBlockManager) == free
            assert not free or manager.windows == (0, 32, 32, 32)
        runs[free] = simulate(config, work, LinearCost(), hybrid, 512, 4)
    assert runs[True].output_tokens == runs[False].output_tokens == 2400
    grouped, one = runs[True].strategy_stats, runs[False].strategy_stats
    # decoding sequences sent back to the store for room: 6 against 20 (each a copy out and in)
    assert runs[True].preemptions < runs[False].preemptions / 2
    assert grouped["swapped_out_tokens"] < one["swapped_out_tokens"]
    assert grouped["copy_seconds"] < one["copy_seconds"]
    assert runs[True].elapsed_s < runs[False].elapsed_s
