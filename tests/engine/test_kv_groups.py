"""KV layer groups (engine/kv_groups.py, engine/group_blocks.py): which layers share a group and a
slot, the release arithmetic per group (windowed groups release, global ones keep everything),
what the scheduler's questions count, preemption, and the prefix cache over rows (a match never
hands out a windowed block inside a window that was evicted, and stops where a row breaks)."""
from __future__ import annotations

import math

import pytest

from batchinfer.engine.group_blocks import GroupedBlockManager
from batchinfer.engine.kv_cache import PLACEHOLDER_BLOCK
from batchinfer.engine.kv_groups import blocks_per_sequence, group_layout

BS, WINDOW = 16, 24


def manager(num_blocks=64, windows=(0, WINDOW), prefix=False) -> GroupedBlockManager:
    return GroupedBlockManager(num_blocks, BS, windows, prefix_caching=prefix)


def test_layouts_of_gemma2_gemma3_and_models_without_hybrid_windows():
    gemma2 = group_layout([16, 0, 16, 0])
    assert (gemma2.windows, gemma2.page_layers) == ((0, 16), 2)
    assert gemma2.layer_group == (1, 0, 1, 0) and gemma2.layer_slot == (0, 0, 1, 1)
    # Gemma 3 1B: 22 windowed layers, a global one every sixth: groups of 4, the last of 2
    gemma3 = group_layout([0 if (i + 1) % 6 == 0 else 512 for i in range(26)])
    assert gemma3.windows == (0, 512, 512, 512, 512, 512, 512) and gemma3.page_layers == 4
    assert gemma3.layer_group[5] == 0 and gemma3.layer_slot[:6] == (0, 1, 2, 3, 0, 0)
    assert gemma3.slots_of(0, 6) == [0, 1, 2, 3] and gemma3.slots_of(5, 6) == [0]
    assert gemma3.layer_caches(["s0", "s1", "s2", "s3"], 4, 8) == ["s0", "s0", "s1", "s2"]
    assert group_layout([]) is None and group_layout([0, 0]) is None
    assert group_layout([16, 16]) is None                 # every layer windowed: one table
    assert blocks_per_sequence((0, 24), 256, BS) == 16 + 3


@pytest.mark.parametrize("first_query, released", [(0, 0), (38, 0), (39, 1), (55, 2), (100, 4)])
def test_the_windowed_group_releases_and_the_global_group_keeps(first_query, released):
    bm = manager()
    bm.grow("a", first_query + 1)
    slots = math.ceil((first_query + 1) / BS)
    assert bm.num_held_blocks("a") == 2 * slots and bm.blocks_needed("a", first_query + 1) == 0
    global_table = list(bm.block_table("a"))
    free = bm.num_free_blocks
    assert bm.release_outside_window("a", first_query) == released
    assert bm.block_table("a") == global_table
    assert bm.group_tables("a")[0][:released] == [PLACEHOLDER_BLOCK] * released
    assert bm.held_per_group("a") == [slots, slots - released]
    assert bm.num_free_blocks == free + released and bm.window_freed_blocks == released
    assert bm.release_outside_window("a", first_query) == 0
    bm.check_invariants()


def test_blocks_needed_and_room_count_every_group():
    bm = manager(num_blocks=10, windows=(0, WINDOW, WINDOW))
    assert bm.blocks_needed("a", 33) == 9 and bm.can_grow("a", 48)
    assert not bm.can_grow("a", 49)                        # 4 slots x 3 groups > 10
    bm.grow("a", 48)
    assert bm.num_free_blocks == 1 and bm.usage() == pytest.approx(0.9)
    bm.release_outside_window("a", 47)                     # keys 24.. seen: slot 0 goes, twice
    assert bm.num_free_blocks == 3 and bm.held_per_group("a") == [3, 2, 2]
    with pytest.raises(MemoryError):
        bm.grow("a", 65)
    assert bm.capacity_tokens == 3 * BS and bm.max_concurrency(48) == pytest.approx(10 / 9)
    bm.check_invariants()


def test_decode_to_300_tokens_holds_the_window_in_the_windowed_group():
    bm = manager()
    bound = math.ceil(WINDOW / BS) + 1
    computed = 0
    while computed < 300:
        bm.grow("a", computed + 1)
        computed += 1
        bm.release_outside_window("a", computed)
        bm.check_invariants()
    assert bm.peak_group_blocks == [math.ceil(300 / BS), bound]


def test_preemption_frees_every_group_and_the_recompute_starts_empty():
    bm = manager(num_blocks=12)
    bm.grow("a", 80)
    bm.release_outside_window("a", 80)
    bm.grow("b", 16)
    bm.free("a")
    bm.check_invariants()
    assert bm.num_free_blocks == 10 and not bm.block_table("a") and not bm.group_tables("a")[0]
    bm.grow("a", 48)
    assert bm.held_per_group("a") == [3, 3]
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 12
    bm.check_invariants()


def test_share_tables_holds_the_donors_blocks_once_more():
    bm = manager()
    bm.grow("a", 64)
    bm.release_outside_window("a", 64)
    bm.share_tables("b", "a")
    assert bm.block_table("b") == bm.block_table("a")
    assert bm.group_tables("b") == bm.group_tables("a")
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 64
    bm.check_invariants()


def run(bm, seq, tokens, chunk=16):
    """Computes `tokens` chunk by chunk as the engine would: grow, step, index, release."""
    computed = bm.match_prefix(seq, tokens)
    while computed < len(tokens):
        n = min(chunk, len(tokens) - computed)
        bm.grow(seq, computed + n)
        computed += n
        bm.cache_computed(seq, tokens, computed)
        bm.release_outside_window(seq, computed)
        bm.check_invariants()


def test_prefix_match_takes_the_global_blocks_and_the_windows_rows():
    """80 tokens computed and freed: a request with the same 80 and more matches 4 blocks; its
    windowed table starts with placeholders up to the window of position 64 and the parked
    companions after it (released ones, still intact)."""
    bm = manager(prefix=True)
    prompt = list(range(100, 180))
    run(bm, "a", prompt)
    rows = list(bm.group_tables("a")[0])
    bm.free("a")
    bm.check_invariants()
    assert bm.match_prefix("b", prompt + [1, 2]) == 80
    first = (80 - WINDOW + 1) // BS                        # 3: slots 3.. are in the window
    assert bm.group_tables("b")[0] == [PLACEHOLDER_BLOCK] * first + rows[first:5]
    assert bm.block_table("b")[:5] == bm.block_table("b") and len(bm.block_table("b")) == 5
    bm.check_invariants()


@pytest.mark.parametrize("evicted, matched", [(2, 80), (4, 0)])
def test_a_prefix_whose_window_rows_were_evicted_is_cut_back(evicted, matched):
    """The parked blocks evict oldest first: the companions released behind the window (slots
    0-2), then the freed sequence's rows from the tail, each anchor first. Two evicted (slots 0
    and 1's): the whole prefix still matches, its window needing slots 3 and 4 only. Four (slot
    2's companion and slot 4's anchor, whose companion goes back to the pool): every shorter
    prefix's window needs a row that is gone, so nothing matches."""
    bm = manager(num_blocks=16, prefix=True)
    prompt = list(range(100, 180))                         # 5 slots x 2 groups
    run(bm, "a", prompt)
    rows = list(bm.group_tables("a")[0])
    bm.free("a")
    bm.grow("x", 16 * 3)                                   # the 6 free blocks: no eviction
    bm.grow("y", 16 * evicted // 2)
    bm.check_invariants()
    assert bm.match_prefix("b", prompt + [1]) == matched
    if matched:
        assert bm.group_tables("b")[0] == [PLACEHOLDER_BLOCK] * 3 + rows[3:]
    bm.check_invariants()
    bm.free("b")
    bm.free("y")
    run(bm, "b", prompt + [1])
    for seq in "bx":
        bm.free(seq)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_a_recomputed_prefix_mends_the_rows_that_lost_companions():
    """a computes 128 tokens; while it decodes, the companions released behind its window are
    evicted (rows 0-5 lose theirs), so after a is freed its first 80 tokens match nothing. b
    recomputes them: the anchors it registers are a's, and its windowed blocks fill a's empty
    slots, so a third request matches all 80 tokens (it used to match none until a's anchors
    were evicted)."""
    bm = manager(num_blocks=20, prefix=True)
    long = list(range(100, 228))
    run(bm, "a", long)                                      # 8 anchors, slots 0-5 released
    assert bm.held_per_group("a") == [8, 2] and bm.prefix.num_evictable == 6
    bm.grow("x", 16 * 5)                                    # 4 free + the 6 parked companions
    bm.free("x")
    bm.free("a")
    bm.check_invariants()
    prompt = long[:80]
    assert bm.match_prefix("b", prompt + [1]) == 0           # rows 3 and 4 lack companions
    run(bm, "b", prompt + [1])
    bm.free("b")
    bm.check_invariants()
    assert bm.match_prefix("c", prompt + [2]) == 80
    assert bm.group_tables("c")[0][:3] == [PLACEHOLDER_BLOCK] * 3
    bm.check_invariants()
    bm.free("c")
    assert bm.num_free_blocks == 20
    bm.check_invariants()


def test_an_evicted_anchor_orphans_its_parked_companion():
    """PrefixIndex: an anchor evicted while its companion is parked drops the row and hands the
    companion back as an orphan (free, cached nowhere)."""
    from batchinfer.engine.prefix_cache import PrefixIndex

    index = PrefixIndex()
    assert index.register(5, None, (1, 2)) == 5
    index.attach(5, 0, 9, 1)
    assert index.companion(5, 0) == 9 and index.is_cached(9)
    index.park(5)
    index.park(9)
    assert index.evict() == 5
    assert index.take_orphans() == [9] and index.orphans == []
    assert not index.is_cached(9) and not index.is_evictable(9) and index.num_evictable == 0


def test_free_parks_rows_whole_so_eviction_takes_the_tail_row():
    """A freed sequence parks its rows tail first, each anchor before its companions: eviction
    takes the last row's anchor (its parked companion goes back to the pool, the orphan path),
    and the first row stays whole and matchable (companions first left anchors without rows)."""
    bm = manager(num_blocks=4, prefix=True)
    run(bm, "a", list(range(100, 132)))                    # 2 slots x 2 groups, nothing released
    row0 = bm.block_table("a")[0], bm.group_tables("a")[0][0]
    bm.free("a")
    assert bm.num_free_blocks == 4 and bm.prefix.num_evictable == 4
    bm.grow("b", 16)                                       # 2 blocks: anchor 1 and its orphan
    bm.check_invariants()
    assert bm.num_free_blocks == 2 and bm.prefix.num_cached == 1
    assert bm.prefix.companion(row0[0], 0) == row0[1]
    assert bm.match_prefix("c", list(range(100, 140))) == 16
    assert bm.block_table("c") == [row0[0]] and bm.group_tables("c")[0] == [row0[1]]
    assert bm.num_free_blocks == 0
    bm.check_invariants()
    bm.free("c")
    bm.free("b")
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_evicting_an_anchor_returns_its_parked_row_to_the_pool():
    bm = manager(num_blocks=4, prefix=True)
    run(bm, "a", list(range(100, 132)))                    # 2 slots x 2 groups, all indexed
    bm.free("a")
    assert bm.num_free_blocks == 4 and bm.prefix.num_cached == 2
    bm.grow("b", 32)                                       # evicts everything
    assert bm.prefix.num_cached == 0 and bm.match_prefix("c", list(range(100, 140))) == 0
    bm.check_invariants()


def engine_config(free=True, strategy=None, **scheduler):
    """A real EngineConfig; strategy: None, or a StrategyParams (baseline, seesaw)."""
    from batchinfer.engine.config import EngineConfig

    config = EngineConfig(cache={"free_outside_window": free}, scheduler=scheduler)
    config.strategy = strategy
    return config


def test_pipeline_stages_store_only_the_slots_their_layers_use():
    """A stage stores, for every block, the slots its layers use. Gemma 3 1B at PP=2 in the
    one-stage layout uses all 4 slots on both stages (a windowed group of layers 0-3 lives on
    stage 0, yet stage 1 stores its blocks' 4 slots for its own groups); by stage, each group takes
    2 layers of its kind from each stage in slots only that stage uses: 2 slots per block per
    stage, the same 7 groups, half the bytes per request. The 5:1 pattern on 6 layers split 3 + 3:
    4 groups of one layer per stage (each windowed group pairs a stage-0 layer with a stage-1
    one) where the one-stage layout's 6 single-layer groups cost a request 421 blocks at 4,096
    tokens against 355."""
    gemma3_layers = [0 if (i + 1) % 6 == 0 else 512 for i in range(26)]
    stages = [(0, 13), (13, 26)]
    one, staged = group_layout(gemma3_layers), group_layout(gemma3_layers, stages)
    assert [len(one.slots_of(*s)) for s in stages] == [4, 4]
    assert [len(staged.slots_of(*s)) for s in stages] == [2, 2]
    assert staged.slots_of(0, 13) == [0, 1] and staged.slots_of(13, 26) == [2, 3]
    assert staged.windows == one.windows and staged.page_layers == 4
    assert [staged.layer_group[layer] for layer in (5, 11, 17, 23)] == [0, 0, 0, 0]
    for group in range(staged.num_groups):       # no two layers of a group share a slot
        slots = [staged.layer_slot[layer] for layer in range(26)
                 if staged.layer_group[layer] == group]
        assert len(slots) == len(set(slots))
    toy = [512] * 5 + [0]
    paired = group_layout(toy, [(0, 3), (3, 6)], BS, 4096)
    assert paired.windows == (0, 512, 512, 512) and paired.page_layers == 2
    assert paired.layer_group == (1, 2, 3, 1, 2, 0) and paired.layer_slot == (0, 0, 0, 1, 1, 1)
    assert paired.blocks_per_sequence(4096, BS) == 256 + 3 * 33
    assert group_layout(toy).blocks_per_sequence(4096, BS) == 256 + 5 * 33
    # one stage keeps vLLM's uniform page whatever max_model_len (page 4, 7 groups)
    assert (one.page_layers, one.num_groups) == (4, 7)
    short = group_layout(gemma3_layers, [(0, 26)], BS, 2048)
    assert (short.page_layers, short.num_groups) == (4, 7)
    # more groups only for over 10% of the bytes: Gemma 2 9B split 23 + 19 would save 5.5% at
    # 8,192 tokens with 23 groups; it keeps the one-stage layout's 2
    gemma2_9b = [4096 if i % 2 == 0 else 0 for i in range(42)]
    assert group_layout(gemma2_9b, [(0, 23), (23, 42)], BS, 8192) == group_layout(gemma2_9b)


def test_groups_only_with_freeing_on_and_strategies_counting_the_block_manager(caplog):
    """Every strategy of the engine runs the groups (Seesaw's tiers move a table per group); a
    strategy that says its KV arithmetic counts one table per sequence keeps every block,
    logged."""
    import logging
    from types import SimpleNamespace
    from typing import ClassVar, Literal

    from batchinfer.engine.kv_groups import groups_for
    from batchinfer.runner.recipe import strategy_class
    from batchinfer.strategies.base import StrategyParams

    arch = SimpleNamespace(layer_windows=(16, 0))
    assert groups_for(engine_config(), arch).windows == (0, 16)
    for name in ("baseline", "gllm", "tdpipe", "sipipe", "sidp", "seesaw"):
        strategy = strategy_class(name).model_validate({"name": name})
        assert groups_for(engine_config(strategy=strategy), arch).windows == (0, 16)
    assert groups_for(engine_config(free=False), arch) is None
    assert groups_for(engine_config(), SimpleNamespace(layer_windows=(16, 16))) is None

    class OneTable(StrategyParams):
        name: Literal["one-table"] = "one-table"
        kv_layer_groups: ClassVar[bool] = False

    config = engine_config().model_copy(update={"strategy": OneTable()})
    with caplog.at_level(logging.INFO, logger="batchinfer.engine.kv_groups"):
        assert groups_for(config, arch) is None
    assert "strategy one-table keeps every block" in caplog.text


def test_a_step_grows_every_group_before_the_window_releases():
    """The capacity rule: a windowed group holds the window before a step's first query and
    the step's tokens; the largest step is a whole prompt under SB, a chunk under HB (the
    baseline strategy's own keys where it has them)."""
    from batchinfer.engine.errors import ConfigError
    from batchinfer.engine.kv_groups import check_group_capacity, step_tokens
    from batchinfer.strategies.base import BaselineStrategy

    assert blocks_per_sequence((0, 16), 256, BS) == 16 + 2                  # decoding
    assert blocks_per_sequence((0, 16), 256, BS, step_tokens=256) == 2 * 16
    assert blocks_per_sequence((0, 16), 256, BS, step_tokens=128) == 16 + 10
    assert blocks_per_sequence((0, 16), 256, BS, step_tokens=16) == 16 + 3
    assert step_tokens(engine_config(policy="sb"), 256)[0] == 256
    assert step_tokens(engine_config(policy="hb", max_num_batched_tokens=128), 256)[0] == 128
    assert step_tokens(engine_config(policy="hb", max_num_batched_tokens=128, chunk_size=32),
                       256)[0] == 32
    assert step_tokens(engine_config(policy="hb"), 256)[0] == 256           # 2048: the whole
    baseline = engine_config(strategy=BaselineStrategy(policy="hb", max_num_batched_tokens=64))
    tokens, setting = step_tokens(baseline, 256)
    assert tokens == 64 and "strategy.max_num_batched_tokens" in setting
    layout = group_layout([16, 0])
    check_group_capacity(layout, 26, BS, 256, (128, "hb"))
    with pytest.raises(ConfigError, match="holds 25 blocks .* holds up to 26"):
        check_group_capacity(layout, 25, BS, 256, (128, "hb"))


def test_the_cuda_graphs_padding_block_is_one_block_whatever_the_groups():
    bm = manager(num_blocks=8, windows=(0, WINDOW, WINDOW))
    block = bm.reserve_block("pad")
    assert bm.num_free_blocks == 7 and bm.block_table("pad") == [block]
    assert bm.held_per_group("pad") == [1, 0, 0]
    bm.check_invariants()
    bm.grow("a", 32)
    assert bm.num_free_blocks == 1
    bm.free("pad")
    bm.free("a")
    assert bm.num_free_blocks == 8
    bm.check_invariants()
    full = manager(num_blocks=3, windows=(0, WINDOW, WINDOW))
    full.grow("a", 16)
    assert full.reserve_block("pad") is None


def test_one_block_manager_choice_and_capacity_for_both_builds():
    """kv_groups.make_block_manager (the one-process and the multi-process builds): a table per
    group with groups, one table (released behind a window where every layer has one) without;
    kv_capacity says what each block manager says of itself (the log and engine_info)."""
    from batchinfer.engine.kv_cache import BlockManager
    from batchinfer.engine.kv_groups import kv_capacity, make_block_manager

    layout = group_layout([16, 0, 16, 0])
    grouped = make_block_manager(layout, 40, BS, prefix_caching=True)
    assert isinstance(grouped, GroupedBlockManager) and grouped.windows == (0, 16)
    assert grouped.prefix is not None
    plain = make_block_manager(None, 40, BS, prefix_caching=False, window=24)
    assert type(plain) is BlockManager and plain.window == 24 and plain.prefix is None
    for bm, groups in ((grouped, layout), (plain, None)):
        tokens, concurrency = kv_capacity(groups, 40, BS, 256)
        assert tokens == bm.capacity_tokens
        assert concurrency == pytest.approx(bm.max_concurrency(256))
