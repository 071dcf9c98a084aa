"""Automatic prefix caching in the block manager (engine/kv_cache.py, engine/prefix_cache.py):
matching, LRU eviction, a fully cached prompt, and a property test with forced hash collisions
that blocks never leak and are never shared across different token contents."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine.kv_cache import BlockManager

BS = 4


def _run(bm: BlockManager, seq_id: str, tokens: list[int]) -> int:
    """Admits a sequence as a scheduler would: cached prefix, then blocks for the rest, computed
    and indexed; -> the tokens that came from the cache."""
    cached = bm.match_prefix(seq_id, tokens)
    bm.count_admission(len(tokens), cached)
    bm.grow(seq_id, len(tokens))
    bm.cache_computed(seq_id, tokens, len(tokens))
    return cached


def test_a_later_sequence_reuses_the_blocks_of_its_prefix():
    bm = BlockManager(16, BS, prefix_caching=True)
    prompt = list(range(100, 114))                     # 3 full blocks + 2 tokens
    assert _run(bm, "a", prompt) == 0
    first = bm.block_table("a")[:3]
    bm.free("a")
    assert bm.num_free_blocks == 16                    # cached blocks count as free room
    assert _run(bm, "b", prompt[:12] + [7, 8, 9]) == 12
    assert bm.block_table("b")[:3] == first
    assert _run(bm, "c", prompt[:5] + [1] * 10) == 4   # diverges inside the second block
    assert bm.block_table("c")[0] == first[0]
    bm.check_invariants()
    assert bm.prefix_hit_tokens == 16


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(16, BS, prefix_caching=True)
    prompt = list(range(16))                           # exactly 4 blocks
    _run(bm, "a", prompt)
    bm.free("a")
    assert bm.match_prefix("b", prompt) == 12          # the 4th block is computed again
    assert bm.blocks_needed("b", 16) == 1
    bm.grow("b", 16)
    bm.cache_computed("b", prompt, 16)                 # an equal block is cached: not twice
    bm.free("b")
    bm.check_invariants()


def test_running_sequences_share_cached_blocks_by_reference_count():
    bm = BlockManager(8, BS, prefix_caching=True)
    prompt = list(range(9))
    _run(bm, "a", prompt)
    assert _run(bm, "b", prompt) == 8                  # a still runs: its blocks are shared
    assert bm.block_table("a")[:2] == bm.block_table("b")[:2]
    bm.free("a")
    bm.check_invariants()
    assert bm.num_free_blocks == 8 - 3                 # b holds 2 shared + 1 own
    bm.free("b")
    assert bm.num_free_blocks == 8


def test_blocks_nobody_holds_are_evicted_least_recently_used_first():
    bm = BlockManager(4, BS, prefix_caching=True)
    old, new = list(range(0, 9)), list(range(50, 59))
    _run(bm, "old", old)
    bm.free("old")                                     # 2 full blocks cached, 1 plain free
    _run(bm, "new", new)
    bm.free("new")                                     # its 2 blocks took the free + 1 cached
    assert bm.prefix.num_cached == 3                   # old head; new: 2 (its tail is partial)
    # the old prefix lost its tail block (freed tail first, so evicted first) but not its head
    assert bm.match_prefix("again", old) == 4
    assert bm.match_prefix("again-new", new) == 8
    bm.check_invariants()


def test_a_colliding_hash_never_returns_another_prefix():
    bm = BlockManager(32, BS, prefix_caching=True, hash_fn=lambda _: 0)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9, 9]
    _run(bm, "a", a)
    assert _run(bm, "b", b) == 4                       # same first block, different second
    assert bm.block_table("b")[1] != bm.block_table("a")[1]
    assert _run(bm, "a2", a) == 8
    assert bm.block_table("a2")[:2] == bm.block_table("a")[:2]
    bm.check_invariants()


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["run", "free"]), st.integers(0, 5),
                              st.lists(st.integers(0, 2), min_size=1, max_size=14)),
                    max_size=40),
       collide=st.booleans())
def test_property_blocks_never_leak_or_mix_contents(ops, collide):
    """Random admissions and frees of sequences over a 3-token alphabet (prefixes repeat), with
    a hash that may map everything to one key. A shadow of each block's written contents checks
    that a matched block holds exactly the tokens the sequence needs there."""
    bm = BlockManager(12, BS, prefix_caching=True, hash_fn=(lambda _: 7) if collide else hash)
    shadow: dict[int, tuple[int, ...]] = {}            # block -> tokens its KV was written for
    live: dict[str, list[int]] = {}
    for op, slot, tokens in ops:
        seq_id = f"s{slot}"
        if op == "free" or seq_id in live:
            if seq_id in live:
                bm.free(seq_id)
                del live[seq_id]
            bm.check_invariants()
            continue
        cached = bm.match_prefix(seq_id, tokens)
        assert cached % BS == 0 and cached < len(tokens)
        table = bm.block_table(seq_id)
        for i, block in enumerate(table):
            assert shadow[block] == tuple(tokens[i * BS:(i + 1) * BS])
        if not bm.can_grow(seq_id, len(tokens)):
            bm.free(seq_id)
            bm.check_invariants()
            continue
        bm.grow(seq_id, len(tokens))
        table = bm.block_table(seq_id)
        for i in range(cached // BS, len(table)):      # the forward writes these blocks' KV
            shadow[table[i]] = tuple(tokens[i * BS:(i + 1) * BS])
        bm.cache_computed(seq_id, tokens, len(tokens))
        live[seq_id] = tokens
        bm.check_invariants()
    for seq_id in list(live):
        bm.free(seq_id)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_a_prefix_being_computed_makes_the_next_sequence_wait_for_it():
    bm = BlockManager(32, BS, prefix_caching=True)
    shared = list(range(10, 22))                       # 3 blocks
    first, second = shared + [1, 2], shared + [3, 4]
    assert bm.match_prefix("a", first) == 0
    bm.grow("a", len(first))
    bm.start_computing("a", first)
    assert bm.match_prefix("b", second) == 0
    assert bm.computing_elsewhere("b", second)         # a computes b's first block right now
    assert not bm.computing_elsewhere("c", [9] * 14)   # another prefix does not wait
    bm.free("b")
    bm.computed("a", 8)                                # a chunk of 8 tokens came back
    bm.cache_computed("a", first, 8)
    assert bm.match_prefix("b", second) == 8
    assert bm.computing_elsewhere("b", second)         # its third block is still in the works
    bm.free("b")
    bm.computed("a", 14)
    bm.cache_computed("a", first, 14)
    assert bm.match_prefix("b", second) == 12
    assert not bm.computing_elsewhere("b", second)
    bm.free("a")
    bm.free("b")
    assert not bm._computing                           # nothing left marked
    bm.check_invariants()
