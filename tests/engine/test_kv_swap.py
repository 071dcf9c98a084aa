"""Preemption by swapping (memory.preemption_mode: swap, engine/kv_swap.py): the swap area's
bookkeeping and copies, the baseline schedulers bringing swapped sequences back, and the engine's
greedy tokens equal to the recomputing reference under KV pressure."""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.config import CacheConfig, EngineConfig
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.group_blocks import GroupedBlockManager
from batchinfer.engine.kv_cache import BlockManager
from batchinfer.engine.kv_swap import (SWAP_IN, SWAP_OUT, SwapSpace, allocate_swap_area,
                                       apply_kv_swaps, attach_swap_space, swap_blocks_for,
                                       swap_unsupported_reason)
from batchinfer.engine.request import SequenceStatus
from batchinfer.engine.batching_policies import HybridBatching, SeparateBatching
from tests.engine.test_scheduler import run_step, seq
from tests.strategy_e2e import (E2E_PARAMS, E2E_PROMPTS, TIGHT, assert_context_dependent,
                                 tight_reference)


def _caches(num_layers: int, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_layers, 2, num_blocks, 2, 4, 3)        # [L, K/V, blocks, heads, bs, dim]
    storage = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    return [(storage[layer, 0], storage[layer, 1]) for layer in range(num_layers)]


def test_swap_out_frees_the_device_blocks_and_swap_in_copies_them_back_in_order():
    device, swap = BlockManager(8, 4, watermark=0.0), SwapSpace(4, 4)
    device.grow("a", 10)                                 # blocks 0, 1, 2
    device.grow("b", 4)                                  # block 3
    kv = _caches(2, 8)
    saved = [(k[:3].clone(), v[:3].clone()) for k, v in kv]
    area = allocate_swap_area(kv, swap.num_blocks)
    swap.swap_out(device, "a", 10)
    assert device.num_free_blocks == 7 and swap.store.num_free_blocks == 1
    device.grow("c", 12)                                 # takes a's three blocks back
    ops = swap.take_ops()
    assert [op[0] for op in ops] == [SWAP_OUT] * 3 and swap.take_ops() == []
    apply_kv_swaps(ops, kv, area)
    for k, v in kv:                                      # c's prefill overwrites a's old blocks
        k[device.block_table("c")] = -1.0
        v[device.block_table("c")] = -1.0
    device.free("c")
    swap.swap_in(device, "a", 10)
    ops = swap.take_ops()
    assert [op[0] for op in ops] == [SWAP_IN] * 3
    apply_kv_swaps(ops, kv, area)
    table = device.block_table("a")
    for (k, v), (k0, v0) in zip(kv, saved):
        assert torch.equal(k[table], k0) and torch.equal(v[table], v0)
    assert swap.store.num_free_blocks == 4
    assert swap.summary()["swap_outs"] == 1 and swap.summary()["swap_ins"] == 1
    device.check_invariants()


def test_copies_decided_together_run_in_the_order_they_were_decided():
    """A swap out into the swap-area block a swap in just freed, in the same plan: run in the
    order decided, the swap in reads the block before the swap out overwrites it."""
    device, swap = BlockManager(2, 4, watermark=0.0), SwapSpace(1, 4)
    kv = _caches(1, 2)
    area = allocate_swap_area(kv, 1)
    device.grow("x", 4)                                  # block 0
    device.grow("y", 4)                                  # block 1
    x_kv, y_kv = kv[0][0][0].clone(), kv[0][0][1].clone()
    swap.swap_out(device, "x", 4)                        # device 0 -> area 0
    apply_kv_swaps(swap.take_ops(), kv, area)
    device.grow("z", 4)                                  # z takes block 0
    kv[0][0][0] = -5.0
    device.free("z")
    assert not swap.can_swap_out(4)                      # the one area block is x's
    swap.swap_in(device, "x", 4)                         # area 0 -> a device block
    swap.swap_out(device, "y", 4)                        # device 1 -> area 0, freed just now
    ops = swap.take_ops()
    assert [op[0] for op in ops] == [SWAP_IN, SWAP_OUT]
    apply_kv_swaps(ops, kv, area)
    assert torch.equal(kv[0][0][device.block_table("x")[0]], x_kv)
    assert torch.equal(area[0][0][0], y_kv)


def test_a_plan_with_copies_needs_a_swap_area():
    with pytest.raises(RuntimeError, match="no swap area"):
        apply_kv_swaps([(SWAP_OUT, 0, 0)], _caches(1, 2), [])


def test_who_can_swap_and_how_big_the_area_is():
    hb = HybridBatching(BlockManager(8, 4), 4, 64, 64)
    assert swap_unsupported_reason(hb.block_manager, hb) is None
    assert "layer groups" in swap_unsupported_reason(
        GroupedBlockManager(8, 4, (0, 16)), hb)
    assert "sliding window" in swap_unsupported_reason(BlockManager(8, 4, window=16), hb)

    class Recomputes:
        pass
    assert "only recomputes" in swap_unsupported_reason(BlockManager(8, 4), Recomputes())
    assert attach_swap_space(BlockManager(8, 4), Recomputes(), 10) == 0
    cache = CacheConfig(preemption_mode="swap", swap_space="1MiB")
    assert swap_blocks_for(cache, 4096) == 256
    assert swap_blocks_for(CacheConfig(swap_space="1MiB"), 4096) == 0     # recompute
    with pytest.raises(ConfigError, match="memory.swap_space"):
        swap_blocks_for(cache, 2 * 2**20)


def test_the_automatic_cpu_budget_leaves_the_swap_area_out():
    from batchinfer.engine.build import kv_budget

    arch = type("Arch", (), {"hidden_size": 64, "q_size": 64, "kv_size": 32, "vocab_size": 100,
                             "ffn_activation_width": lambda self: 128,
                             "kv_window": lambda self: 0})()
    base = EngineConfig(cache={"memory_utilization": 1.0})
    swapping = EngineConfig(cache={"memory_utilization": 1.0, "preemption_mode": "swap",
                                   "swap_space": "1GiB"})
    cpu = torch.device("cpu")
    available = 3 * 2**30                                # under the automatic budget's cap
    assert kv_budget(base, arch, cpu, 4, available) - \
        kv_budget(swapping, arch, cpu, 4, available) == 2**30
    # where the replica will recompute anyway, the area is not set aside
    grouped = type("Groups", (), {})()
    assert kv_budget(swapping, arch, cpu, 4, available, groups=grouped) == \
        kv_budget(base, arch, cpu, 4, available)
    from batchinfer.strategies import STRATEGIES

    recomputing = swapping.model_copy(update={"strategy": STRATEGIES["gllm"]()})
    assert kv_budget(recomputing, arch, cpu, 4, available) == kv_budget(base, arch, cpu, 4,
                                                                          available)


@pytest.mark.parametrize("name", ["baseline", "tdpipe", "gllm", "seesaw", "sipipe", "sidp"])
def test_a_strategy_says_whether_its_scheduler_swaps(name):
    """StrategyParams.swaps_preempted (what sizes the KV budget before the scheduler exists)
    is what the scheduler it builds does."""
    from batchinfer.strategies import STRATEGIES

    params = STRATEGIES[name]()
    if name == "seesaw":                 # built with its CPU store (strategies/seesaw/build.py)
        from batchinfer.strategies.seesaw.scheduler import SeesawScheduler

        swaps = SeesawScheduler.swaps_preempted
    else:
        swaps = params.make_scheduler(BlockManager(64, 16), 2048, 2).swaps_preempted
    assert params.swaps_preempted == bool(swaps)


@pytest.mark.parametrize("policy", ["sb", "hb"])
def test_swapped_sequences_come_back_before_new_prompts_and_keep_their_kv(policy):
    bm = BlockManager(6, 4, watermark=0.0)               # 24 tokens in all
    bm.swap = SwapSpace(16, 4)
    cls = SeparateBatching if policy == "sb" else HybridBatching
    sched = cls(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    seqs = [seq(f"s{i}", 7, max_tokens=12) for i in range(4)]
    for s in seqs:
        sched.add(s)
    prefill_tokens, steps, saw_swapped = 0, 0, False
    while sched.has_unfinished():
        swapped_before = bool(sched.swapped)
        for batch in run_step(sched):
            prefill_tokens += batch.counts[0]
            admitted = [i.seq for i in batch.items if i.seq.num_computed_tokens == i.num_tokens]
            if swapped_before and sched.swapped:    # still waiting: no new prompt went past it
                assert not admitted
        saw_swapped |= bool(sched.swapped)
        assert all(s.status is SequenceStatus.SWAPPED for s in sched.swapped)
        bm.check_invariants()
        steps += 1
        assert steps < 200
    assert saw_swapped and sched.num_preemptions > 0
    assert prefill_tokens == 4 * 7                       # nothing recomputed
    assert all(len(s.output_token_ids) == 12 for s in seqs)
    assert bm.num_free_blocks == bm.num_blocks and bm.swap.store.num_free_blocks == 16


def test_a_sequence_brought_back_rejoins_in_arrival_order():
    bm = BlockManager(64, 4, watermark=0.0)
    bm.swap = SwapSpace(16, 4)
    sched = SeparateBatching(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    seqs = [seq(f"s{i}", 5) for i in range(3)]
    for i, s in enumerate(seqs):
        s.request.arrival_index = i
        sched.add(s)
    run_step(sched)                                      # all three prefilled
    sched._preempt(seqs[0])
    assert sched.swapped[0] is seqs[0] and sched.num_swapped == 1
    batch = run_step(sched)[0]                           # s1, s2 decode; then s0 comes back
    assert [i.seq for i in batch.items] == [seqs[1], seqs[2], seqs[0]]
    assert sched.running == seqs and not sched.swapped


def test_sequences_brought_back_together_each_keep_room_for_their_next_token():
    """Room is counted over every sequence a step brings back: one whose next token needs a new
    block keeps it, so the next one in line waits instead of taking that block."""
    bm = BlockManager(4, 4, watermark=0.0)
    bm.swap = SwapSpace(8, 4)
    sched = SeparateBatching(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    a, b = seq("a", 4), seq("b", 3)          # a's next token starts a block, b's fits its own
    for s, prompt in ((a, 4), (b, 3)):
        bm.grow(s.request_id, prompt)
        s.num_computed_tokens = prompt
    bm.grow("filler", 8)                      # two more blocks: the device is full
    for s in (a, b):
        bm.swap.swap_out(bm, s.request_id, s.num_computed_tokens)
        s.status = SequenceStatus.SWAPPED
        sched.swapped.append(s)
    assert bm.num_free_blocks == 2
    assert sched._swap_in() == [a]            # a takes one block and keeps the second for later
    assert sched.swapped[0] is b and bm.num_free_blocks == 1
    assert bm.can_grow("a", 5)
    bm.free("filler")
    assert sched._swap_in() == [b]


@pytest.mark.parametrize("policy", ["sb", "hb"])
def test_virtual_engines_admit_no_prompt_while_one_of_them_has_a_sequence_swapped(policy):
    """Under PP the virtual engines share one pool: a prompt that another engine admitted would
    take the room a swapped sequence waits for."""
    from batchinfer.engine.virtual_engines import VirtualEngines

    bm = BlockManager(16, 4, watermark=0.0)
    bm.swap = SwapSpace(16, 4)
    cls = SeparateBatching if policy == "sb" else HybridBatching
    engines = [cls(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
               for _ in range(2)]
    virtual = VirtualEngines(engines)
    first, second = engines
    old = seq("old", 5)
    first.add(old)
    run_step(first)                           # prefilled
    first._preempt(old)
    assert old.status is SequenceStatus.SWAPPED and virtual.num_swapped == 1
    bm.grow("filler", 4 * 15)                 # no room for it to come back yet
    second.add(seq("new", 3))
    assert not any(item.seq.request_id == "new" for batch in second.schedule()
                   for item in batch.items)
    assert second.num_waiting == 1
    second.pool_sharers = None                # alone, the second engine would have admitted it
    assert any(item.seq.request_id == "new" for batch in second.schedule()
               for item in batch.items)


def test_a_full_swap_area_falls_back_to_recompute():
    bm = BlockManager(6, 4, watermark=0.0)
    bm.swap = SwapSpace(1, 4)                            # one block: no sequence fits
    sched = HybridBatching(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    for i in range(3):
        sched.add(seq(f"s{i}", 7, max_tokens=12))
    while sched.has_unfinished():
        run_step(sched)
    assert sched.num_preemptions > 0 and bm.swap.num_swap_outs == 0


def test_abort_gives_the_swap_area_back():
    bm = BlockManager(6, 4, watermark=0.0)
    bm.swap = SwapSpace(16, 4)
    sched = SeparateBatching(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    for i in range(4):
        sched.add(seq(f"s{i}", 7, max_tokens=12))
    while not sched.swapped:
        run_step(sched)
    aborted = sched.abort_all()
    assert len(aborted) == 4 and not sched.has_unfinished()
    assert bm.swap.store.num_free_blocks == 16


@pytest.mark.parametrize("sections", [
    {"scheduler": {"policy": "hb", "max_num_batched_tokens": 64, "chunk_size": 24},
     "cache": {"enable_prefix_caching": True}},
    {"scheduler": {"policy": "hb", "async_scheduling": True}},
    {"scheduler": {"policy": "sb"}, "cache": {"enable_prefix_caching": True}},
], ids=["hb-small-chunks-prefix-caching", "hb-launching-ahead", "sb-prefix-caching"])
def test_the_engine_swapping_gives_the_recomputing_reference_tokens(sections):
    """Launching ahead (async scheduling) waits while a sequence is swapped out: a step that
    brings one back can take any number of blocks, and a stopped sequence must not return."""
    from batchinfer.engine.engine import Engine

    reference = [list(tokens) for tokens in tight_reference()]
    assert_context_dependent(reference)
    cache = {**TIGHT["cache"], **sections.get("cache", {}), "preemption_mode": "swap",
             "swap_space": "32MiB"}
    config = EngineConfig(model=TIGHT["model"], cache=cache, scheduler=sections["scheduler"])
    with Engine.from_config(config) as engine:
        outs = engine.generate(E2E_PROMPTS, E2E_PARAMS)
        stats = engine.stats()
        prompt_tokens = sum(len(engine.tokenizer.encode(p)) for p in E2E_PROMPTS)
        engine.scheduler.block_manager.check_invariants()
    assert len(outs) == len(E2E_PROMPTS)
    assert [o.output_token_ids for o in outs] == reference
    assert engine.info["preemption_mode"] == "swap"
    assert engine.info["async_scheduling"] == sections["scheduler"].get("async_scheduling", False)
    assert stats["num_preemptions"] > 0 and stats["kv_swap"]["swap_outs"] == stats["num_preemptions"]
    assert stats["kv_swap"]["swap_ins"] == stats["kv_swap"]["swap_outs"]
    assert stats["computed_prefill_tokens"] <= prompt_tokens        # no prompt computed twice
