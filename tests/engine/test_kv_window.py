"""The block manager under a sliding window: which leading blocks a sequence releases (the
arithmetic at the window's edge, chunked prefill, decode), what a released slot holds, a
preemption that frees a sequence with released slots and its recompute, and the prefix cache:
released blocks it indexed stay matchable with their contents, blocks it never indexed never
become matchable."""
from __future__ import annotations

import math

import pytest

from batchinfer.engine.kv_cache import PLACEHOLDER_BLOCK, BlockManager

BS, WINDOW = 16, 24


def manager(num_blocks=32, window=WINDOW, prefix=False) -> BlockManager:
    return BlockManager(num_blocks, BS, prefix_caching=prefix, window=window)


@pytest.mark.parametrize("first_query, released", [
    (0, 0), (23, 0), (38, 0),    # query 38 sees keys 15..38: block 0 (keys 0-15) still needed
    (39, 1),                     # query 39 sees 16..39: block 0 is behind every window
    (54, 1), (55, 2), (100, 4)])
def test_blocks_behind_the_window_of_the_first_query_are_released(first_query, released):
    bm = manager()
    bm.grow("a", first_query + 1)
    table = list(bm.block_table("a"))
    free_before = bm.num_free_blocks
    assert bm.release_outside_window("a", first_query) == released
    assert bm.block_table("a")[:released] == [PLACEHOLDER_BLOCK] * released
    assert bm.block_table("a")[released:] == table[released:]      # positions map unchanged
    assert len(bm.block_table("a")) == len(table)
    assert bm.num_free_blocks == free_before + released
    assert bm.num_held_blocks("a") == len(table) - released
    assert bm.window_freed_blocks == released
    assert bm.release_outside_window("a", first_query) == 0           # nothing twice
    bm.check_invariants()


def test_without_a_window_nothing_is_released():
    bm = manager(window=0)
    bm.grow("a", 200)
    assert bm.release_outside_window("a", 199) == 0
    assert bm.num_held_blocks("a") == len(bm.block_table("a")) == 13


@pytest.mark.parametrize("chunk", [1, 16, 40])
def test_a_sequence_holds_its_window_and_its_chunk_not_its_context(chunk):
    """Chunked prefill then decode to 300 tokens: after each step the sequence releases what its
    next queries cannot see; it never holds more than ceil((window + chunk - 1) / block) + 1."""
    bm = manager()
    bound = math.ceil((WINDOW + chunk - 1) / BS) + 1
    computed, peak = 0, 0
    while computed < 300:
        bm.grow("a", computed + chunk)            # the step's tokens, as a scheduler reserves
        peak = max(peak, bm.num_held_blocks("a"))
        computed += chunk                         # the step came back
        bm.release_outside_window("a", computed)
        bm.check_invariants()
    assert peak <= bound and bm.peak_seq_blocks == peak
    assert bm.window_freed_blocks == (computed - WINDOW + 1) // BS
    if chunk == 1:
        assert peak == math.ceil(WINDOW / BS) + 1


def test_preemption_frees_the_rest_and_the_recompute_starts_from_a_full_table():
    bm = manager(num_blocks=8)
    bm.grow("a", 100)
    bm.release_outside_window("a", 99)            # 4 of its 7 blocks released
    bm.grow("b", 16)
    assert bm.num_free_blocks == 8 - 3 - 1
    bm.free("a")                                  # preempted: the placeholders are not freed
    bm.check_invariants()
    assert bm.num_free_blocks == 7 and bm.num_held_blocks("a") == 0
    bm.grow("a", 64)                              # the recompute's first chunk
    assert bm.num_held_blocks("a") == len(bm.block_table("a")) == 4
    bm.check_invariants()


def test_released_blocks_are_reused_by_other_sequences():
    bm = manager(num_blocks=6)
    bm.grow("a", 96)                              # all 6 blocks
    assert not bm.can_grow("b", 16)
    bm.release_outside_window("a", 95)
    assert bm.can_grow("b", 48)
    new = bm.grow("b", 48)
    assert set(new) <= set(range(6)) and not set(new) & set(bm.block_table("a")[4:])
    bm.check_invariants()


def test_released_blocks_the_prefix_cache_indexed_stay_matchable_with_their_contents():
    bm = manager(prefix=True)
    tokens = list(range(100, 196))                # 6 full blocks
    bm.grow("a", len(tokens))
    blocks = list(bm.block_table("a"))
    bm.cache_computed("a", tokens, len(tokens))
    assert bm.release_outside_window("a", len(tokens)) == 4
    bm.check_invariants()
    # the released, indexed blocks are parked (nobody holds them), still cached
    assert all(bm.prefix.is_evictable(b) for b in blocks[:4])
    assert bm.match_prefix("b", tokens + [1]) == 96
    assert bm.block_table("b") == blocks          # the same KV, the parked ones taken back
    bm.check_invariants()


def test_evicted_released_blocks_leave_the_index():
    bm = manager(num_blocks=6, prefix=True)
    tokens = list(range(100, 196))
    bm.grow("a", 96)
    bm.cache_computed("a", tokens, 96)
    bm.release_outside_window("a", 96)            # blocks 0-3 parked
    bm.grow("b", 64)                              # takes (evicts) the 4 parked blocks
    bm.check_invariants()
    assert bm.match_prefix("c", tokens + [1]) == 0   # the chain's head is gone: no match
    bm.check_invariants()


def test_a_block_released_before_it_was_indexed_is_never_indexed():
    """Released ahead of the prefix cache (a step launched ahead): the sequence's chain ends,
    and its released slots are never registered (they hold the placeholder)."""
    bm = manager(prefix=True)
    tokens = list(range(100, 196))
    bm.grow("a", 96)
    bm.release_outside_window("a", 96)
    bm.cache_computed("a", tokens, 96)
    assert not bm.has_uncached_blocks("a", 96)
    assert bm.match_prefix("b", tokens + [1]) == 0
    assert bm.prefix.num_evictable == 0
    bm.check_invariants()


def test_releasing_the_last_indexed_block_ends_the_chain():
    """The next block is registered under its parent's block id: once the parent is released
    (parked, evictable, then reusable for other content) nothing may be chained onto it."""
    bm = manager(prefix=True, window=8)
    tokens = list(range(100, 164))
    bm.grow("a", 32)
    bm.cache_computed("a", tokens, 32)            # blocks 0-1 indexed
    assert bm.release_outside_window("a", 40) == 2
    bm.grow("a", 48)
    bm.cache_computed("a", tokens, 48)            # block 2: not chained onto released block 1
    assert bm.match_prefix("b", tokens[:48] + [1]) == 32
    bm.check_invariants()


def test_shared_blocks_released_by_one_sequence_stay_held_by_the_other():
    bm = manager(prefix=True)
    tokens = list(range(100, 164))                # 4 full blocks
    bm.grow("a", 64)
    bm.cache_computed("a", tokens, 64)
    assert bm.match_prefix("b", tokens + [7]) == 64
    bm.release_outside_window("a", 64)            # a lets go of blocks 0-1; b still holds them
    bm.check_invariants()
    assert not any(bm.prefix.is_evictable(b) for b in bm.block_table("b"))
    bm.free("b")
    bm.free("a")
    bm.check_invariants()
    assert bm.prefix.num_evictable == 4


@pytest.mark.parametrize("family, extra, window", [
    ("Phi3Config", {"sliding_window": 24}, 24),             # every layer windowed
    ("Phi3Config", {"sliding_window": None}, 0),
    ("Gemma3TextConfig", {"sliding_window": 16, "layer_types": ["sliding_attention",
                                                                 "full_attention"]}, 0),
    ("Qwen3Config", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0}, 32),
    ("MistralConfig", {"sliding_window": 24}, 24),          # Mistral 7B v0.1's kind
    ("MistralConfig", {"sliding_window": None}, 0),
])
def test_only_models_whose_every_layer_has_a_window_release(family, extra, window):
    """A global layer needs the whole context: with one, the cache releases nothing (the blocks
    hold every layer's K/V), and the switch turns releasing off."""
    import transformers

    from batchinfer.engine.config import CacheConfig
    from batchinfer.engine.model.arch import arch_from_dict
    from tests.tiny_families import TINY

    arch = arch_from_dict(getattr(transformers, family)(**{**TINY, **extra}).to_dict())
    assert arch.kv_window() == window
    assert CacheConfig().kv_window(arch) == window
    assert CacheConfig(free_outside_window=False).kv_window(arch) == 0


def test_the_switch_is_validated():
    from pydantic import ValidationError

    from batchinfer.engine.config import CacheConfig

    with pytest.raises(ValidationError, match="free_outside_window"):
        CacheConfig(free_outside_window="sometimes")
