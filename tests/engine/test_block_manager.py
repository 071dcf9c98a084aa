"""Block manager: after any mix of grow / share / free / preempt, no block leaks or is held twice."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine.kv_cache import BlockManager, KVCacheSpec

ops = st.lists(st.tuples(st.sampled_from(["grow", "free", "share", "preempt"]),
                         st.integers(0, 7), st.integers(1, 70)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_no_leak_no_double_hold(operations):
    bm = BlockManager(num_blocks=24, block_size=4)
    tokens: dict[int, int] = {}
    for op, seq, n in operations:
        if op == "grow":
            target = tokens.get(seq, 0) + n
            if bm.can_grow(seq, target):
                new = bm.grow(seq, target)
                assert len(set(new)) == len(new)
                tokens[seq] = target
            else:
                with pytest.raises(MemoryError):
                    bm.grow(seq, target)
        elif op in ("free", "preempt"):  # preemption by recompute frees exactly like a finish
            bm.free(seq)
            tokens.pop(seq, None)
        elif op == "share" and seq not in tokens:
            donors = [s for s in tokens if bm.block_table(s)]
            if donors:
                donor = donors[n % len(donors)]
                prefix = bm.block_table(donor)[: 1 + n % len(bm.block_table(donor))]
                bm.share(seq, prefix)
                tokens[seq] = len(prefix) * bm.block_size
        bm.check_invariants()
        for s, t in tokens.items():
            assert len(bm.block_table(s)) * bm.block_size >= t
    for seq in list(tokens):
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_sharing_a_free_block_is_refused():
    bm = BlockManager(4, 2)
    bm.grow("a", 2)
    block = bm.block_table("a")[0]
    bm.free("a")
    with pytest.raises(ValueError):
        bm.share("b", [block])


def test_capacity_from_budget():
    spec = KVCacheSpec.from_budget(2**20, num_layers=2, block_size=16, num_kv_heads=2, head_dim=8,
                                   dtype_bytes=4)
    assert spec.bytes_per_block == 2 * 2 * 2 * 16 * 8 * 4
    assert spec.num_blocks == 2**20 // spec.bytes_per_block
    assert spec.capacity_tokens == spec.num_blocks * 16
