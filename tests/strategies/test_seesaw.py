"""Seesaw (issue 8): the tier allocator, the transition-minimizing schedule, weight re-sharding,
end-to-end runs through several layout switches that give the baseline's greedy tokens, and what
the ablations change (issue 41): which thread copies the KV, and how much of it the CPU store
holds. The auto layouts: test_seesaw_auto.py."""
from __future__ import annotations

import functools
from collections import deque
from pathlib import Path

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine.config import EngineConfig, ParallelConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.kv_cache import BlockManager
from batchinfer.engine.model.causal_lm import ModelPartition
from batchinfer.engine.model.loader import build_model, load_arch
from batchinfer.engine.model.sources import resolve_model_dir
from batchinfer.strategies.seesaw.executor import Reshard
from batchinfer.resharding.kv_store import ShardView, allocate_store
from batchinfer.resharding.kv_tiers import KVTiers, Transfer
from batchinfer.resharding.prefetcher import Prefetcher
from batchinfer.resharding.weights import HostWeights, ShapeOnlyGroup, shared_norms
from batchinfer.strategies.seesaw.build import resolve_layouts, tier_blocks
from batchinfer.strategies.seesaw.params import SeesawParams
from batchinfer.strategies.seesaw.scheduler import SeesawScheduler
from batchinfer.sim.scheduler_driver import complete, launch, make_seq
from tests.strategy_e2e import E2E_PARAMS, E2E_PROMPTS, TIGHT, tight_reference

# SmolLM2's shape with 8 heads (TP=2 splits them) and 8 of its 30 layers: the switches move KV
# per layer alike, so depth only costs the suite time
DUMMY8_LAYERS = 8
DUMMY8 = {"load_format": "dummy", "max_model_len": 128,
          "hf_overrides": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                           "num_hidden_layers": DUMMY8_LAYERS}}
# the same heads and KV with a hidden size of 128 (SmolLM2's 576 spent the end-to-end tests' time in
# the vocabulary head and MLPs, which the switches do not touch differently); at 64 every prompt
# got the same greedy reply, which a run reading the wrong KV would give too
DUMMY8_NARROW = {**DUMMY8, "hf_overrides": {**DUMMY8["hf_overrides"], "hidden_size": 128,
                                            "intermediate_size": 256}}


# --- the CPU store's allocator and the moves between tiers ----------------------------------------
moves = st.lists(st.tuples(st.sampled_from(["admit", "out", "in", "done", "finish"]),
                           st.integers(0, 5), st.integers(1, 40)), max_size=150)


@settings(max_examples=300, deadline=None)
@given(moves)
def test_tiers_never_leak_or_double_allocate(operations):
    exercise_tiers(KVTiers(BlockManager(12, 4), BlockManager(20, 4)), operations)


def exercise_tiers(tiers: KVTiers, operations) -> None:
    """Random admissions, decode steps (op "decode"), moves, completions and finishes, each
    followed by the tiers' invariants; a block manager with windows releases behind them after
    each step, as the engine does. At the end both tiers are empty."""
    device_free, store_free = tiers.device.num_free_blocks, tiers.store.num_free_blocks
    tokens: dict[str, int] = {}
    for op, i, n in operations:
        rid = f"s{i}"
        moving = tiers.is_moving(rid)
        on_device = bool(tiers.device.block_table(rid))
        in_store = bool(tiers.store.block_table(rid))
        if op == "admit" and not (on_device or in_store):
            if tiers.device.can_grow(rid, n):
                tiers.device.grow(rid, n)
                tiers.device.release_outside_window(rid, n)
                tokens[rid] = n
        elif op == "decode" and on_device and not in_store and not moving:
            if tiers.device.can_grow(rid, tokens[rid] + 1):
                tokens[rid] += 1
                tiers.device.grow(rid, tokens[rid])
                tiers.device.release_outside_window(rid, tokens[rid])
        elif op == "out" and on_device and not in_store and not moving:
            if tiers.can_swap_out(tokens[rid]):
                transfer = tiers.swap_out(rid, tokens[rid])
                assert len(transfer.store_blocks) == tiers.store_blocks_for(tokens[rid])
        elif op == "in" and in_store and not on_device and not moving:
            if tiers.can_swap_in(tokens[rid]):
                transfer = tiers.swap_in(rid, tokens[rid])
                assert len(transfer.device_blocks) == tiers.store_blocks_for(tokens[rid])
        elif op == "done" and tiers.pending:
            ids = sorted(tiers.pending)
            tiers.complete(ids[n % len(ids)])
        elif op == "finish" and rid in tokens and not moving:
            tiers.free(rid)
            del tokens[rid]
        tiers.check_invariants()
        for held in tokens:   # every live sequence's KV is in exactly one tier unless moving
            places = bool(tiers.device.block_table(held)) + bool(tiers.store.block_table(held))
            assert places == (2 if tiers.is_moving(held) else 1)
    for tid in list(tiers.pending):
        tiers.complete(tid)
    for rid in tokens:
        tiers.free(rid)
    tiers.check_invariants()
    assert tiers.device.num_free_blocks == device_free
    assert tiers.store.num_free_blocks == store_free


def test_a_move_holds_both_tiers_until_done():
    tiers = KVTiers(BlockManager(4, 4), BlockManager(4, 4))
    tiers.device.grow("a", 7)
    out = tiers.swap_out("a", 7)
    assert out.device_blocks == tuple(tiers.device.block_table("a")) and len(out.store_blocks) == 2
    with pytest.raises(ValueError):
        tiers.free("a")
    tiers.complete(out.transfer_id)
    assert not tiers.device.block_table("a") and tiers.swapped_out_tokens == 7
    back = tiers.swap_in("a", 7)
    assert len(back.device_blocks) == 2
    tiers.complete(back.transfer_id)
    assert not tiers.store.block_table("a") and tiers.device.num_free_blocks == 2


# --- the schedule ----------------------------------------------------------------------------------
def drive(sched: SeesawScheduler, max_iterations: int = 20_000) -> list[dict]:
    """The engine's loop without a model: up to the current phase's depth in flight, copies
    reported done one iteration after they start. -> the switches, in order."""
    in_flight: deque = deque()
    copies: list[int] = []
    switches = []
    for _ in range(max_iterations):
        if not sched.has_unfinished():
            return switches
        depth = sched.prefill_depth if sched.phase == "prefill" else sched.decode_depth
        batches = launch(sched) if len(in_flight) < depth else []
        for action in sched.take_actions():
            if isinstance(action, Transfer):
                copies.append(action.transfer_id)
            else:
                assert isinstance(action, Reshard) and not in_flight and not copies
                switches.append({"to": action.name, "waiting": len(sched.waiting),
                                 "in_store": len(sched.stored), "running": len(sched.running),
                                 "store_free": sched.tiers.store.num_free_blocks})
        in_flight.extend(batches)
        sched.check_invariants()
        if batches and len(in_flight) < depth:
            continue
        if copies:
            done, copies[:] = list(copies), []
            sched.on_transfers_done(done)
        elif in_flight:
            complete(sched, in_flight.popleft())
        elif not batches:
            raise AssertionError(f"stalled in {sched.phase}: {len(sched.waiting)} waiting")
    raise AssertionError("did not finish")


def _scheduler(policy="transition_minimizing", store_blocks=24, device_blocks=10):
    return SeesawScheduler(BlockManager(device_blocks, 8), BlockManager(store_blocks, 8),
                           max_num_seqs=64, max_num_batched_tokens=32, max_model_len=64,
                           prefill_depth=2, decode_depth=1, policy=policy)


def _workload(n=24):
    return [make_seq(i, 10 + (i * 7) % 20, 4 + (i * 5) % 30) for i in range(n)]


def test_transition_minimizing_switches_only_with_the_store_full_or_empty():
    sched = _scheduler()
    for seq in _workload():
        sched.add(seq)
    switches = drive(sched)
    assert len(switches) >= 3 and switches[0]["to"] == "decode"
    for s in switches:
        if s["to"] == "decode":      # the next prompt no longer fits the store, or none is left
            assert s["waiting"] == 0 or s["store_free"] < 4
        else:                        # the store drained onto the device first
            assert s["in_store"] == s["running"] or s["waiting"] > 0
    sched.check_invariants()
    assert sched.tiers.device.num_free_blocks == 10 and sched.tiers.store.num_free_blocks == 24
    assert sched.tiers.swapped_in_tokens == sched.tiers.swapped_out_tokens > 0


def test_the_papers_fig2_policies_switch_more_or_less_often():
    counts = {}
    for policy in ("transition_minimizing", "prefill_prioritizing", "decode_prioritizing"):
        sched = _scheduler(policy)
        seqs = _workload()
        for seq in seqs:
            sched.add(seq)
        counts[policy] = len(drive(sched))
        assert all(seq.is_finished for seq in seqs)
    assert counts["prefill_prioritizing"] > counts["transition_minimizing"]
    assert counts["decode_prioritizing"] <= counts["transition_minimizing"]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["transition_minimizing", "prefill_prioritizing", "decode_prioritizing"]),
       st.integers(6, 20), st.integers(0, 30), st.integers(1, 64), st.integers(1, 2),
       st.integers(1, 2), st.lists(st.tuples(st.integers(2, 37), st.integers(1, 38)),
                                   min_size=1, max_size=30))
def test_every_workload_finishes_under_every_schedule(policy, device, extra, max_seqs, p_depth,
                                                      d_depth, lengths):
    """Any cache sizes (the store at least the device), depths and lengths: no stall, everything
    finishes, every block of both tiers is free at the end."""
    sched = SeesawScheduler(BlockManager(device, 8), BlockManager(device + extra, 8), max_seqs,
                            32, 40, prefill_depth=p_depth, decode_depth=d_depth, policy=policy)
    seqs = [make_seq(i, p, max(1, min(n, 40 - p))) for i, (p, n) in enumerate(lengths)]
    for seq in seqs:
        sched.add(seq)
    drive(sched)
    assert all(seq.is_finished for seq in seqs)
    assert sched.block_manager.num_free_blocks == device
    assert sched.tiers.store.num_free_blocks == device + extra


def test_decode_sequences_go_back_to_the_store_when_the_device_runs_out():
    """A device of 3 blocks, sequences that grow past it: the newest idle one is copied out
    (not recomputed) and comes back later; everything finishes."""
    sched = SeesawScheduler(BlockManager(4, 4), BlockManager(40, 4), max_num_seqs=8,
                            max_num_batched_tokens=16, max_model_len=16, decode_depth=1)
    seqs = [make_seq(i, 3, 9) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    drive(sched)
    assert all(seq.is_finished for seq in seqs)
    assert sched.num_preemptions > 0 and all(seq.num_preemptions == 0 for seq in seqs)


def test_abort_with_copies_in_flight_frees_both_tiers_when_they_report():
    sched = _scheduler()
    seqs = _workload(6)
    for seq in seqs:
        sched.add(seq)
    batch = launch(sched)[0]
    complete(sched, batch)                     # prefilled: copies out start
    copies = [a.transfer_id for a in sched.take_actions() if isinstance(a, Transfer)]
    assert copies
    aborted = sched.abort_all()
    assert set(map(id, aborted)) == set(map(id, seqs)) and not sched.has_unfinished()
    sched.on_transfers_done(copies)            # the ranks report after the abort
    sched.check_invariants()
    assert sched.tiers.device.num_free_blocks == 10 and sched.tiers.store.num_free_blocks == 24


# --- the ablations: where the copies run, what the store holds -----------------------------------
@pytest.mark.parametrize("threaded,thread", [(True, Prefetcher.THREAD_NAME), (False, "MainThread")])
def test_copies_run_on_the_prefetcher_thread_only_with_the_async_pipeline(threaded, thread):
    """async_pipeline's switch: with it a copy runs (and is reported) on the prefetcher's thread
    after submit returns; without it, on the caller's (the worker's main) thread inside submit."""
    store = allocate_store(4, 2, 2, 4, 8, torch.float32)
    paged = torch.arange(2 * 2 * 3 * 2 * 4 * 8, dtype=torch.float32).view(2, 2, 3, 2, 4, 8)
    reports = []
    done = threading.Event()

    def notify(ids, seconds, name):
        reports.append((ids, name, threading.current_thread().name))
        done.set()

    prefetcher = Prefetcher(store, notify, threaded=threaded)
    prefetcher.attach(paged, ShardView(0, 2, 0, 2))
    try:
        prefetcher.submit(7, "out", [1], [3])
        assert done.is_set() == (not threaded)      # inline: done before submit returns
        prefetcher.drain()
    finally:
        prefetcher.close()
    assert reports == [([7], thread, thread)]
    assert torch.equal(store[3], paged[:, :, 1])


SMOL = {"max_model_len": 128}


def _tiers(cpu_kv_tier: bool) -> tuple[int, int]:
    """(device blocks, store blocks) as the engine sizes them: SmolLM2, PP=3 -> TP=3, 4 MiB of
    KV per rank and a 64 MiB store."""
    from batchinfer.engine.runtime.build import model_setup

    params = SeesawParams(decode_tp=3, decode_pp=1, cpu_kv_tier=cpu_kv_tier,
                          cpu_kv_cache_memory="64MiB")
    config = _seesaw_config(params, {"pp": 3}, SMOL, "4MiB")
    arch = model_setup(config).arch
    layouts = resolve_layouts(config, params, arch)
    device, _, store = tier_blocks(config, params, arch, layouts, 4 << 20, 4, 128)
    return device, store


@pytest.mark.parametrize("cpu_kv_tier", [True, False])
def test_without_the_cpu_tier_the_store_holds_what_the_device_holds(cpu_kv_tier):
    """cpu_kv_tier's switch, on the schedule the engine would run: without the tier the store is
    the device cache's size and every prefill phase stops when the device would be full; with it
    prefill runs past the device cache (its prompts wait in the store)."""
    device_blocks, store_blocks = _tiers(cpu_kv_tier)
    assert (store_blocks == device_blocks) == (not cpu_kv_tier)
    sched = SeesawScheduler(BlockManager(device_blocks, 16), BlockManager(store_blocks, 16),
                            max_num_seqs=256, max_num_batched_tokens=256, max_model_len=128,
                            prefill_depth=3, decode_depth=1)
    seqs = [make_seq(i, 40 + (i * 13) % 60, 8 + (i * 7) % 20) for i in range(3 * device_blocks)]
    for seq in seqs:
        sched.add(seq)
    switches = drive(sched)
    assert all(seq.is_finished for seq in seqs)
    to_decode = [s for s in switches if s["to"] == "decode"]
    # every prefill phase but the last stopped for lack of room: the next prompt (at most 7
    # blocks) did not fit the store
    assert len(to_decode) >= 2 and all(s["store_free"] < 7 for s in to_decode if s["waiting"])
    held = [(store_blocks - s["store_free"]) * 16 for s in to_decode]
    peak = sched.strategy_summary()["cpu_store_peak_tokens"]
    device_tokens = device_blocks * 16
    if cpu_kv_tier:      # prefill ran past what the device holds
        assert peak > device_tokens and max(held) > device_tokens
    else:                # prefill stopped at the device's capacity
        assert peak <= device_tokens and max(held) <= device_tokens


def test_one_rank_samples_on_the_last_stage_of_both_layouts():
    """Every (c_p, c_d) pair `auto` may pick over 4 ranks of the 8-head dummy: the sampling rank
    is on the last stage of each layout (prefill TP -> decode PP once had no sampler at all:
    rank 0 sampled, and PP's last stage is rank 3)."""
    from batchinfer.engine.runtime.build import model_setup
    from batchinfer.engine.runtime.layout import ParallelLayout
    from batchinfer.strategies.seesaw.auto_layout import splits
    from batchinfer.strategies.seesaw.build import sampling_rank

    arch = model_setup(EngineConfig(model=DUMMY8)).arch
    layouts = [ParallelLayout.resolve(ParallelConfig(tp=tp, pp=pp), arch)
               for tp, pp in splits(4, arch)]
    assert len(layouts) == 3                          # TP=4, TP=2 x PP=2, PP=4
    for prefill in layouts:
        for decode in layouts:
            rank = sampling_rank({"prefill": prefill, "decode": decode})
            for lay in (prefill, decode):
                assert lay.info(rank).stage == lay.pp - 1
            if decode.info(prefill.sampling_rank(0)).stage == decode.pp - 1:
                assert rank == prefill.sampling_rank(0)     # as before where that worked


# --- weights ---------------------------------------------------------------------------------------
def _params(model) -> dict:
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "dense_weight"):   # the engine's fast linears (oneDNN or blocked)
            out[name] = module.dense_weight()
            if module.bias is not None:
                out[f"{name}.bias"] = module.bias
    for name, param in model.named_parameters():
        out[name] = param.detach()
    return out


def test_resharded_weights_equal_the_direct_shards():
    """SmolLM2 (9 / 3 heads split by 3): stage 0 of PP=2, then TP rank 1 of 3 re-sharded from the
    host copy, equal what the direct loader reads from the safetensors for that shard."""
    model_dir, _ = resolve_model_dir(None)
    arch = load_arch(Path(model_dir))
    pp_stage = ModelPartition(0, 15)
    tp_shard = ModelPartition(0, None, tp_rank=1, tp_size=3)
    host = HostWeights.load(Path(model_dir), arch, [pp_stage, tp_shard])
    first, _ = host.build(arch, torch.float32, torch.device("cpu"), 64, pp_stage)
    kept = shared_norms(first, tp_shard, arch)
    assert len(kept) == 2 * 15          # the norms of layers 0-14 (no final norm on stage 0)
    second, stats = host.build(arch, torch.float32, torch.device("cpu"), 64, tp_shard,
                               ShapeOnlyGroup(tp_shard), kept=kept)
    assert stats.bytes_kept > 0 and stats.bytes_from_host > 0
    direct = build_model(Path(model_dir), arch, torch.float32, torch.device("cpu"), 64, tp_shard,
                         tp_group=ShapeOnlyGroup(tp_shard))
    ours, theirs = _params(second), _params(direct)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


def test_the_host_copy_is_counted_as_the_tensors_it_keeps():
    """host_copy_bytes equals what HostWeights.load holds for the same partitions, and a
    rank of both layouts keeps (up to) the whole model."""
    from batchinfer.resharding.weights import host_copy_bytes

    model_dir, _ = resolve_model_dir(None)
    arch = load_arch(Path(model_dir))
    pp_stage = ModelPartition(0, 15)
    tp_shard = ModelPartition(0, None, tp_rank=1, tp_size=3)
    for partitions in ([pp_stage], [pp_stage, tp_shard]):
        host = HostWeights.load(Path(model_dir), arch, partitions)
        assert host_copy_bytes(arch, partitions) == host.nbytes
    assert host_copy_bytes(arch, [pp_stage]) < host_copy_bytes(arch, [pp_stage, tp_shard])


def test_seesaw_with_host_copies_beyond_the_hosts_memory_is_refused_before_the_workers(
        monkeypatch):
    """The weights fit and the ranks' host copies with the CPU KV store do not: a ConfigError
    that names them and their size, before the store is allocated (4 GiB touched for nothing)
    and before any worker starts (on a GPU the copies alone are counted)."""
    from batchinfer.engine import build as engine_build
    from batchinfer.strategies.seesaw import build as seesaw_build
    from batchinfer.engine.build import GiB, check_weights_fit
    from batchinfer.engine.runtime import build as runtime_build

    model_dir, _ = resolve_model_dir(None)
    arch = load_arch(Path(model_dir), DUMMY8["hf_overrides"])
    kv = 16 << 20
    weights = arch.num_params() * 4 + kv          # fits; with two ranks' host copies it cannot
    monkeypatch.setattr(engine_build, "available_memory", lambda device: weights + (1 << 20))
    config = _seesaw_config(SeesawParams(decode_tp=2, decode_pp=1), {"pp": 2}, DUMMY8, str(kv))
    started = []
    monkeypatch.setattr(runtime_build.WorkerPool, "start", lambda *a, **k: started.append(a))
    monkeypatch.setattr(seesaw_build, "allocate_store", lambda *a, **k: started.append("store"))
    with pytest.raises(ConfigError, match=r"\+ Seesaw's host copies of the weights .* and its "
                                          r"CPU KV store .* GiB, more "
                                          r"than the .* GiB this host has available"):
        Engine.from_config(config)
    assert not started
    check_weights_fit(config, arch, torch.device("cpu"), torch.float32)     # alone: they fit
    with pytest.raises(ConfigError, match=r"^Seesaw's copies takes 0.5 GiB of host memory"):
        check_weights_fit(config, arch, torch.device("cuda"), torch.bfloat16,
                          host_copy=(GiB // 2, "Seesaw's copies"))


def test_the_store_is_counted_once_before_it_is_allocated_then_not_again(monkeypatch):
    """The host-memory check before the store's allocation counts the ranks' weight copies and
    the store; the one before the workers start counts the copies alone (the allocated store
    already shows in the host's available memory: counting it there too refused jobs that fit)."""
    from batchinfer.engine.runtime import build as runtime_build
    from batchinfer.strategies.seesaw import build as seesaw_build

    checked = []

    def record(config, arch, device, dtype, copies=1, host_copy=(0, "")):
        checked.append(host_copy)

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(seesaw_build, "check_weights_fit", record)
    monkeypatch.setattr(runtime_build, "check_weights_fit", record)
    monkeypatch.setattr(runtime_build.WorkerPool, "start", stop)
    store = 64 << 20
    config = _seesaw_config(SeesawParams(decode_tp=2, decode_pp=1, cpu_kv_cache_memory=store),
                            {"pp": 2}, DUMMY8, str(16 << 20))
    with pytest.raises(Stop):
        Engine.from_config(config)
    # (model_setup's own check of the weights alone comes first, with no host copy)
    (before_store, what_before), (before_workers, what_after) = [c for c in checked if c[0]]
    assert store - (1 << 20) < before_store - before_workers <= store   # whole store blocks
    assert before_workers > 0 and "CPU KV store" in what_before and "store" not in what_after


# --- end to end ------------------------------------------------------------------------------------
def _seesaw_config(params: SeesawParams, parallel: dict, model: dict, kv: str,
                   kv_dtype: str = "auto") -> EngineConfig:
    """A stuck rank (e.g. no sampler in a layout) fails the test in 2 minutes, not 10."""
    return EngineConfig(model=model, cache={"kv_cache_memory": kv, "kv_cache_dtype": kv_dtype},
                        parallel={"step_timeout_seconds": 120, **parallel},
                        scheduler=params.scheduler_config(), strategy=params)


@functools.cache
def _narrow_reference(kv_dtype: str) -> tuple[tuple[int, ...], ...]:
    """The single process's greedy tokens on DUMMY8_NARROW, once per KV dtype for the layouts
    below."""
    config = EngineConfig(model=DUMMY8_NARROW,
                          cache={"kv_cache_memory": "40MiB", "kv_cache_dtype": kv_dtype})
    with Engine.from_config(config) as engine:
        return tuple(tuple(o.output_token_ids) for o in engine.generate(E2E_PROMPTS, E2E_PARAMS))


@pytest.mark.parametrize("prefill,decode,kv_dtype,element", [
    ({"pp": 2}, (2, 1), "auto", 4), ({"pp": 2}, (2, 1), "bfloat16", 2),
    ({"tp": 2}, (1, 2), "auto", 4)], ids=["pp2-tp2", "pp2-tp2-bf16", "tp2-pp2"])
@pytest.mark.slow
def test_two_layouts_equal_the_baseline_through_several_switches(prefill, decode, kv_dtype,
                                                                 element):
    """Dummy 8-head model (hidden size 128): PP=2 prefill and TP=2 decode (and the other way round, which `auto`
    may pick too), a device cache of ~230 tokens and a CPU store of 256: several switches, every
    token equal to the single process's (with a bf16 KV cache too: both tiers and the moves
    between them hold bf16)."""
    reference = [list(tokens) for tokens in _narrow_reference(kv_dtype)]
    assert len({tuple(o[:8]) for o in reference}) >= 5     # the replies depend on their prompts
    token = DUMMY8_LAYERS * 2 * 4 * 64 * element        # KV bytes of a token
    params = SeesawParams(decode_tp=decode[0], decode_pp=decode[1],
                          cpu_kv_cache_memory=token * 256, max_num_batched_tokens=64)
    config = _seesaw_config(params, {**prefill, "pp_balance": "layers"}, DUMMY8_NARROW,
                            str(token * 240 // 2), kv_dtype)
    with Engine.from_config(config) as engine:
        outs = engine.generate(E2E_PROMPTS, E2E_PARAMS)
        events = engine.drain_step_events()
        stats = engine.stats()
        sched = engine.scheduler
    assert [o.output_token_ids for o in outs] == reference
    switches = [d for e in events for d in e.get("decisions", ())]
    assert len(switches) >= 3
    seesaw = stats["strategy_stats"]
    assert seesaw["num_reshards"] == len(switches)
    assert set(seesaw["seconds_by_layout"]) == {"prefill", "decode"}
    assert seesaw["swapped_out_tokens"] >= sum(len(engine.tokenizer.encode(p)) for p in E2E_PROMPTS)
    assert {e["layout"] for e in events} == {"prefill", "decode"}
    assert max(e["kv_store_usage"] for e in events) > 0.5
    # the paper's mechanism, as it ran: every copy on the ranks' prefetcher threads (2 ranks
    # report each), and the store held more KV than the device cache can
    assert seesaw["kv_copies_by_thread"] == {"kv-prefetcher": 2 * sched.tiers.num_transfers}
    assert seesaw["cpu_store_peak_tokens"] > stats["kv_capacity_tokens"]
    sched.check_invariants()
    assert sched.tiers.store.num_free_blocks == sched.tiers.store.num_blocks


@pytest.mark.slow
def test_smollm2_ablations_equal_the_baseline_and_do_what_they_say():
    """SmolLM2 with two pipeline layouts (15 + 15 for prefill, 20 + 10 for decode), without the
    asynchronous pipeline and without the CPU tier: the same greedy tokens as the single process;
    every KV copy ran on the workers' main threads, and the store held no more than the device
    cache (prefill stopped there)."""
    assert TIGHT == {"model": SMOL, "cache": {"kv_cache_memory": "10MiB"}}  # its reference's
    reference = [list(tokens) for tokens in tight_reference()]
    params = SeesawParams(decode_tp=1, decode_pp=2, decode_pp_layers=[20, 10],
                          cpu_kv_cache_memory="40MiB", async_pipeline=False, cpu_kv_tier=False)
    config = _seesaw_config(params, {"pp": 2, "pp_layers": [15, 15]}, SMOL, "5MiB")
    with Engine.from_config(config) as engine:
        outs = engine.generate(E2E_PROMPTS, E2E_PARAMS)
        decisions = [d for e in engine.drain_step_events() for d in e.get("decisions", ())]
        stats = engine.stats()
        transfers = engine.scheduler.tiers.num_transfers
    assert [o.output_token_ids for o in outs] == reference
    seesaw = stats["strategy_stats"]
    assert seesaw["num_reshards"] >= 1
    assert seesaw["kv_copies_by_thread"] == {"MainThread": 2 * transfers} and transfers > 0
    assert seesaw["cpu_store_tokens"] == stats["kv_capacity_tokens"]
    assert seesaw["cpu_store_peak_tokens"] <= stats["kv_capacity_tokens"]
    assert any(d["reason"] == "CPU store full" for d in decisions)


def test_a_layout_the_model_cannot_take_is_a_clear_error():
    """SmolLM2 (9 / 3 heads) over 2 ranks: only PP=2 splits them. Each error names its key and
    what is allowed."""
    allowed = r"allowed over 2 rank\(s\): decode_tp x decode_pp = 1 x 2,"
    params = SeesawParams(decode_tp=2)
    with pytest.raises(ConfigError, match="strategy.decode_tp / decode_pp: .*9 attention heads.*"
                       + allowed):
        Engine.from_config(_seesaw_config(params, {"pp": 2}, SMOL, "5MiB"))
    with pytest.raises(ConfigError, match="strategy.decode_tp: 3 does not divide .* 2 rank.*"
                       + allowed):
        Engine.from_config(_seesaw_config(SeesawParams(decode_tp=3), {"pp": 2}, SMOL, "5MiB"))
    with pytest.raises(ConfigError, match="must use the same 2 ranks.*" + allowed):
        Engine.from_config(_seesaw_config(SeesawParams(decode_tp=1, decode_pp=1), {"pp": 2},
                                          SMOL, "5MiB"))
    small = SeesawParams(decode_tp=1, decode_pp=2, cpu_kv_cache_memory="1MiB")
    with pytest.raises(ConfigError, match="strategy.cpu_kv_cache_memory"):
        Engine.from_config(_seesaw_config(small, {"pp": 2}, SMOL, "5MiB"))


def test_validate_refuses_the_layouts_the_build_refuses(default_model_dir):
    """engine.build.preflight (`batchinfer validate`, `run --dry-run`) runs the layout
    refusals above before any model loads, and a bad decode_pp_layers names that key."""
    from batchinfer.engine.build import preflight
    from batchinfer.engine.model.loader import load_arch

    arch = load_arch(default_model_dir)
    with pytest.raises(ConfigError, match="strategy.decode_tp: 2 does not divide .* 3 rank"):
        preflight(_seesaw_config(SeesawParams(decode_tp=2, decode_pp=1), {"pp": 3}, SMOL,
                                 "5MiB"), arch)
    with pytest.raises(ConfigError, match=r"strategy.decode_pp_layers: \[10, 10, 5\] must list"):
        preflight(_seesaw_config(SeesawParams(decode_tp=1, decode_pp=3,
                                              decode_pp_layers=[10, 10, 5]), {"pp": 3}, SMOL,
                                 "5MiB"), arch)
    preflight(_seesaw_config(SeesawParams(decode_tp=3, decode_pp=1), {"pp": 3}, SMOL, "5MiB"),
              arch)


def test_validate_sizes_the_tiers_and_the_auto_alternatives_as_the_build_does(default_model_dir):
    """With an explicit memory.kv_cache_memory, preflight sizes Seesaw's device cache and CPU
    store as build.tier_blocks does (a store smaller than the device cache is refused before any
    model loads); with prefill_layout: auto, the decode sizes given are checked against every
    alternative the simulation would choose between, and refused only where none can run."""
    from batchinfer.engine.build import preflight
    from batchinfer.engine.model.loader import load_arch

    arch = load_arch(default_model_dir)
    small = SeesawParams(decode_tp=1, decode_pp=2, cpu_kv_cache_memory="1MiB")
    with pytest.raises(ConfigError, match="strategy.cpu_kv_cache_memory: .* fewer than the "
                       "device cache"):
        preflight(_seesaw_config(small, {"pp": 2}, SMOL, "5MiB"), arch, 128)
    preflight(_seesaw_config(small, {"pp": 2}, SMOL, "5MiB"), arch)    # no length: not sized
    preflight(_seesaw_config(small.model_copy(update={"cpu_kv_cache_memory": 64 << 20}),
                             {"pp": 2}, SMOL, "5MiB"), arch, 128)
    auto = {"prefill_layout": "auto", "layout_costs": "h100"}
    with pytest.raises(ConfigError, match="strategy.prefill_layout: auto found no alternative "
                       r"that can run: prefill PP=2 -> decode TP=2: strategy.decode_tp / "
                       "decode_pp: .*9 attention heads"):
        preflight(_seesaw_config(SeesawParams(decode_tp=2, **auto), {"pp": 2}, SMOL, "5MiB"),
                  arch, 128)
    with pytest.raises(ConfigError, match="strategy.decode_tp: 3 does not divide"):
        preflight(_seesaw_config(SeesawParams(decode_tp=3, **auto), {"pp": 2}, SMOL, "5MiB"),
                  arch)
    with pytest.raises(ConfigError, match="auto found no alternative .*cpu_kv_cache_memory"):
        preflight(_seesaw_config(small.model_copy(update=auto), {"pp": 2}, SMOL, "5MiB"),
                  arch, 128)
    preflight(_seesaw_config(SeesawParams(decode_pp=2, **auto), {"pp": 2}, SMOL, "5MiB"),
              arch, 128)

    # blocks are whole: a store of exactly the device cache's 10 blocks in fp32 (10.5 fit the
    # device cache) is 20 against 21 in bf16; `dtype: auto` may run either, so no refusal
    # unless the recipe fixes bf16
    from batchinfer.engine.config import ParallelConfig
    from batchinfer.engine.runtime.build import rank_bytes_per_block
    from batchinfer.engine.runtime.layout import ParallelLayout
    from batchinfer.strategies.seesaw.build import store_bytes_per_block

    layout = ParallelLayout.resolve(ParallelConfig(pp=2), arch)
    device_fp32 = max(rank_bytes_per_block(layout, arch, r, 16, 4) for r in range(2))
    edge = SeesawParams(decode_tp=1, decode_pp=2,
                        cpu_kv_cache_memory=store_bytes_per_block(arch, 16, 4) * 10)
    kv = device_fp32 * 10 + device_fp32 // 2
    preflight(_seesaw_config(edge, {"pp": 2}, SMOL, kv), arch, 128)
    with pytest.raises(ConfigError, match="20 blocks of 16 tokens, fewer than the device "
                                          "cache's 21"):
        preflight(_seesaw_config(edge, {"pp": 2}, {**SMOL, "dtype": "bfloat16"}, kv), arch, 128)
