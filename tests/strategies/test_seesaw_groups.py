"""Seesaw with KV layer groups (issue 42): both tiers keep a table per group, a move pairs only the
blocks the windows still hold, the schedule runs to the end with the windowed tables releasing,
and a tiny Gemma 3 (Gemma 3's 5:1 windowed / global pattern on 6 layers) gives transformers'
greedy tokens through prefill at PP=2, the CPU store and decode at TP=2."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine.group_blocks import GroupedBlockManager
from batchinfer.engine.kv_cache import BlockManager
from batchinfer.engine.kv_groups import blocks_held, group_layout
from batchinfer.resharding.kv_tiers import KVTiers, held_blocks
from batchinfer.strategies.seesaw.scheduler import SeesawScheduler
from batchinfer.sim.scheduler_driver import make_seq
from tests.strategies.test_seesaw import drive, exercise_tiers

WINDOWS = (0, 8, 8)          # a global group and two windowed ones of 8 keys
BS = 4


def _tiers(device_blocks: int = 30, store_blocks: int = 60, groups: bool = True) -> KVTiers:
    """Tiers over the layer groups, or (groups False) over one table of a model windowed on
    every layer (8 keys)."""
    if groups:
        return KVTiers(GroupedBlockManager(device_blocks, BS, WINDOWS),
                       GroupedBlockManager(store_blocks, BS, WINDOWS))
    return KVTiers(BlockManager(device_blocks, BS, window=8), BlockManager(store_blocks, BS, window=8))


def test_blocks_held_is_what_the_manager_holds_after_the_release():
    for tokens in range(1, 60):
        bm = GroupedBlockManager(200, BS, WINDOWS)
        bm.grow("a", tokens)
        bm.release_outside_window("a", tokens)
        assert bm.num_held_blocks("a") == blocks_held(WINDOWS, tokens, BS), tokens
    assert blocks_held((0,), 9, BS) == 3


def test_a_prefilled_sequence_moves_only_what_its_windows_still_need():
    """40 tokens in blocks of 4: the global table holds 10 blocks, each windowed one the 2 that
    hold keys 32-39 (a query at 40 sees 33-40): 14 blocks move, not 30, and come back with the
    same shape; decoding on, the windowed tables grow and release as before the trip."""
    tiers = _tiers()
    device, store = tiers.device, tiers.store
    device.grow("a", 40)
    device.release_outside_window("a", 40)
    assert device.released_slots("a") == (0, 8, 8) and device.num_held_blocks("a") == 14
    out = tiers.swap_out("a", 40)
    assert len(out.device_blocks) == len(out.store_blocks) == 14
    assert store.released_slots("a") == (0, 8, 8) and store.num_held_blocks("a") == 14
    assert out.device_blocks == held_blocks(device, "a", 10)
    tiers.check_invariants()
    tiers.complete(out.transfer_id)
    assert device.num_free_blocks == 30 and tiers.can_swap_in(40, keep_free_sequences=5)
    assert not tiers.can_swap_in(40, keep_free_sequences=6)     # 14 + 6 x 3 tables > 30
    back = tiers.swap_in("a", 40)
    assert back.store_blocks == out.store_blocks and len(back.device_blocks) == 14
    assert device.released_slots("a") == (0, 8, 8)
    tiers.check_invariants()
    tiers.complete(back.transfer_id)
    assert store.num_free_blocks == 60
    device.grow("a", 41)                       # a new slot in every table
    assert device.num_held_blocks("a") == 17
    assert device.release_outside_window("a", 41) == 0
    device.grow("a", 44)
    assert device.release_outside_window("a", 44) == 2     # keys 36-43 from a query at 44
    device.free("a")
    device.check_invariants()
    assert device.num_free_blocks == 30


def test_a_model_windowed_on_every_layer_moves_its_window_only():
    tiers = _tiers(groups=False)
    tiers.device.grow("a", 40)
    tiers.device.release_outside_window("a", 40)
    out = tiers.swap_out("a", 40)
    assert len(out.store_blocks) == 2 and tiers.store.released_slots("a") == (8,)
    tiers.complete(out.transfer_id)
    back = tiers.swap_in("a", 40)
    assert len(back.device_blocks) == 2 and tiers.device.released_slots("a") == (8,)


def test_tiers_refuse_managers_over_other_windows():
    with pytest.raises(ValueError, match="windows"):
        KVTiers(GroupedBlockManager(10, BS, WINDOWS), BlockManager(10, BS))


moves = st.lists(st.tuples(st.sampled_from(["admit", "decode", "out", "in", "done", "finish"]),
                           st.integers(0, 5), st.integers(1, 40)), max_size=150)


@settings(max_examples=300, deadline=None)
@given(moves, st.booleans())
def test_windowed_tiers_never_leak_or_double_allocate(operations, groups):
    exercise_tiers(_tiers(groups=groups), operations)


def _workload():
    return [make_seq(i, 30 + (i * 17) % 50, 20 + (i * 11) % 40) for i in range(24)]


@pytest.mark.parametrize("policy", ["transition_minimizing", "prefill_prioritizing",
                                    "decode_prioritizing"])
def test_the_schedule_finishes_with_groups_and_decodes_more_at_once(policy):
    """The same bytes of device KV and store: as a page of 2 layers in three groups (a global
    one, two windowed of 8 keys), or as one table of the 6 layers (a block 3x the bytes). With
    the groups, long sequences hold a few blocks in the windowed tables, so more of them decode
    on the device at once and fewer layout switches are needed."""
    peaks = {}
    for name, device, store in (("groups", GroupedBlockManager(120, BS, WINDOWS),
                                 GroupedBlockManager(240, BS, WINDOWS)),
                                ("one table", BlockManager(40, BS), BlockManager(80, BS))):
        sched = SeesawScheduler(device, store, max_num_seqs=64, max_num_batched_tokens=256,
                                max_model_len=128, prefill_depth=2, decode_depth=1,
                                policy=policy)
        seqs = _workload()
        for seq in seqs:
            sched.add(seq)
        most = [0]
        on_result = sched.on_result

        def watched(batch, on_result=on_result, sched=sched, most=most):
            most[0] = max(most[0], len(sched.running))
            on_result(batch)

        sched.on_result = watched
        switches = drive(sched)
        assert all(seq.is_finished for seq in seqs)
        assert device.num_free_blocks == device.num_blocks
        assert store.num_free_blocks == store.num_blocks
        peaks[name] = (most[0], len(switches))
    assert peaks["groups"][0] > peaks["one table"][0], peaks
    assert peaks["groups"][1] <= peaks["one table"][1], peaks


def test_the_layout_serves_both_layouts_with_one_slot_range_per_rank():
    """Gemma 3's pattern on 6 layers, prefill PP=2 (3 + 3), decode TP=2: the stage layout (4
    groups, a page of 2 slots, one per stage) is kept; each rank's slots are one range."""
    from types import SimpleNamespace

    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.runtime.layout import ParallelLayout
    from batchinfer.strategies.seesaw.build import seesaw_groups
    from batchinfer.strategies.seesaw.params import SeesawParams

    windows = [16] * 5 + [0]
    arch = SimpleNamespace(layer_windows=windows, num_layers=6, num_kv_heads=2, head_dim=16,
                           num_attention_heads=4)
    config = EngineConfig(cache={"block_size": 16}, strategy=SeesawParams(decode_tp=2))
    layouts = {"prefill": ParallelLayout(tp=1, pp=2, dp=1, layers_per_stage=(3, 3)),
               "decode": ParallelLayout(tp=2, pp=1, dp=1, layers_per_stage=(6,))}
    groups = seesaw_groups(config, arch, layouts, 256)
    assert groups == group_layout(windows, [(0, 3), (3, 6)], 16, 256)
    assert groups.num_groups == 4 and groups.page_layers == 2
    assert groups.slot_range(0, 3) == (0, 1) and groups.slot_range(3, 6) == (1, 2)
    assert groups.slot_range(0, 6) == (0, 2)


@pytest.fixture(scope="module")
def gemma3_pattern(tmp_path_factory, default_model_dir):
    """A tiny Gemma 3 with its 5:1 pattern of windowed (16 keys) and global layers on 6 layers
    -> (model directory, transformers' greedy tokens for the window tests' PROMPTS)."""
    from tests.tiny_families import hf_model, saved_with_greedy
    from tests.window_engines import MAX_NEW, PROMPTS

    model = hf_model("gemma3", num_hidden_layers=6,
                     layer_types=["sliding_attention"] * 5 + ["full_attention"])
    return saved_with_greedy(model, tmp_path_factory.mktemp("gemma3-pattern"),
                             default_model_dir, PROMPTS, MAX_NEW)


@pytest.mark.slow
def test_seesaw_runs_the_groups_through_both_layouts_and_gives_transformers_tokens(
        gemma3_pattern):
    """Prefill at PP=2 (3 + 3 layers), decode at TP=2, the stage layout's 4 groups in pages of
    2 slots (one per prefill stage, both on every decode rank, a head each): the prompts and
    40 tokens each run far past the 16-key window, a CPU store of 48 pages makes the layouts
    switch several times, and every token equals transformers'."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.strategies.seesaw.params import SeesawParams
    from tests.greedy import greedy_tokens
    from tests.window_engines import BLOCK, MAX_NEW, PROMPTS

    path, expected = gemma3_pattern
    page = 2 * 2 * 2 * 16 * BLOCK * 4        # a store block: 2 slots x K, V x 2 heads x 16, fp32
    params = SeesawParams(decode_tp=2, decode_pp=1, cpu_kv_cache_memory=48 * page,
                          max_num_batched_tokens=256)
    # 40 device blocks of a rank's half page (its slot of every head, or both slots of its
    # head): a 128-token prompt's step takes 8 slots in each of the 4 tables
    config = EngineConfig(model={"path": str(path), "max_model_len": 128},
                          cache={"kv_cache_memory": str(40 * page // 2), "block_size": BLOCK},
                          parallel={"pp": 2, "pp_balance": "layers", "step_timeout_seconds": 120},
                          scheduler=params.scheduler_config(), strategy=params)
    with Engine.from_config(config) as engine:
        sched = engine.scheduler
        assert engine.info["kv_groups"]["windows"] == [0, 16, 16, 16]
        assert engine.info["kv_groups"]["page_layers"] == 2
        assert sched.block_manager.num_blocks == 40 and sched.tiers.store.num_blocks == 48
        assert greedy_tokens(engine, PROMPTS * 2, batched=True, max_new=MAX_NEW) == expected * 2
        events = engine.drain_step_events()
        stats = engine.stats()
        sched.check_invariants()
        assert sched.tiers.store.num_free_blocks == 48
        assert sched.block_manager.num_free_blocks == 40
    switches = [d for e in events for d in e.get("decisions", ())]
    assert len(switches) >= 3, switches
    assert stats["kv_window_freed_blocks"] > 0
    assert stats["strategy_stats"]["swapped_in_tokens"] > 0


@pytest.fixture(scope="module")
def phi3_windowed(tmp_path_factory, default_model_dir):
    """A tiny Phi-3 with a 16-key window on every layer -> (directory, transformers' tokens)."""
    from tests.tiny_families import TINY, saved_with_greedy, tiny_model
    from tests.window_engines import MAX_NEW, PROMPTS

    model = tiny_model("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 16})
    assert model.config.num_hidden_layers == TINY["num_hidden_layers"] == 2
    return saved_with_greedy(model, tmp_path_factory.mktemp("phi3-windowed"), default_model_dir,
                             PROMPTS, MAX_NEW)


@pytest.mark.slow
def test_seesaw_keeps_a_window_of_a_model_windowed_on_every_layer(phi3_windowed):
    """One table, released behind the window in both tiers: the 8 sequences' prompts (432
    tokens) pass through a store of 16 blocks (256 tokens) in one prefill phase, each holding
    the two or three blocks its window needs, and the tokens equal transformers'."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.strategies.seesaw.params import SeesawParams
    from tests.greedy import greedy_tokens
    from tests.window_engines import BLOCK, MAX_NEW, PROMPTS

    path, expected = phi3_windowed
    store_block = 2 * 2 * 2 * 16 * BLOCK * 4        # 2 layers x K, V x 2 heads x 16, fp32
    params = SeesawParams(decode_tp=2, decode_pp=1, cpu_kv_cache_memory=16 * store_block)
    config = EngineConfig(model={"path": str(path), "max_model_len": 128},
                          cache={"kv_cache_memory": str(12 * store_block // 2), "block_size": BLOCK},
                          parallel={"pp": 2, "step_timeout_seconds": 120},
                          scheduler=params.scheduler_config(), strategy=params)
    with Engine.from_config(config) as engine:
        sched = engine.scheduler
        assert engine.info["kv_window"] == 16 and "kv_groups" not in engine.info
        assert sched.block_manager.num_blocks == 12 and sched.tiers.store.num_blocks == 16
        assert greedy_tokens(engine, PROMPTS * 2, batched=True, max_new=MAX_NEW) == expected * 2
        events = engine.drain_step_events()
        stats = engine.stats()
    switches = [d for e in events for d in e.get("decisions", ())]
    assert [s["switch"] for s in switches][:1] == ["prefill->decode"]
    assert switches[0]["waiting"] == 0 and switches[0]["in_store"] == 8
    assert stats["kv_window_freed_blocks"] > 0
