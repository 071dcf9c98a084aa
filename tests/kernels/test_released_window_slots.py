"""Blocks released for a sliding window (engine/kv_cache.py): their table slots point at a
placeholder block that may hold anything (another sequence's K/V by now). Every CPU backend must
give the output it gives over the original blocks: it either never reads those slots or masks
them. The Triton kernel's case is in test_triton_attention_windows.py (its interpreter)."""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.attention import AttentionMetadata
from tests.paged_cases import MIXED, cpu_backends, paged_case


def released_case(window: int, block_size: int, seed: int = 3):
    """-> (q, key_cache, value_cache, meta over the original tables, meta whose slots wholly
    before each sequence's first window point at a block of large values)."""
    q, kc, vc, meta = paged_case(seed, 64, 4, 2, block_size, *MIXED)
    poison = kc.shape[0]
    kc = torch.cat([kc, torch.full_like(kc[:1], 100.0)])
    vc = torch.cat([vc, torch.full_like(vc[:1], -100.0)])
    tables = []
    for row, q_len, s_len in zip(meta.block_tables.tolist(), MIXED[0], MIXED[1]):
        n = -(-s_len // block_size)
        released = max(0, (s_len - q_len - window + 1) // block_size)   # as the block manager
        tables.append([poison] * released + row[released:n])
    released = AttentionMetadata.build(*MIXED, tables, block_size, torch.device("cpu"))
    assert any(poison in t for t in tables)
    return q * 4, kc, vc, meta, released


@pytest.mark.parametrize("window,block_size,softcap", [(24, 16, 0.0), (16, 16, 0.0), (37, 8, 0.0),
                                                       (24, 16, 0.3)])
def test_released_slots_do_not_change_the_output(window, block_size, softcap):
    q, kc, vc, meta, released = released_case(window, block_size)
    for backend in cpu_backends():
        expected = backend.attend(q, kc, vc, meta, 0.125, window, softcap)
        got = backend.attend(q, kc, vc, released, 0.125, window, softcap)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=backend.name)


def test_one_slot_more_would_change_it():
    """The case can fail: releasing the first block a window still reaches changes the output."""
    q, kc, vc, meta, _ = released_case(24, 16)
    poison = kc.shape[0] - 1
    tables = [list(row) for row in meta.block_tables.tolist()]
    s_len, q_len = MIXED[1][6], MIXED[0][6]                 # a decode row at 130 keys
    first_needed = (s_len - q_len - 24 + 1) // 16
    tables[6][first_needed] = poison
    over = AttentionMetadata.build(*MIXED, tables, 16, torch.device("cpu"))
    for backend in cpu_backends():
        diff = backend.attend(q, kc, vc, over, 0.125, 24) - backend.attend(q, kc, vc, meta, 0.125, 24)
        assert diff.abs().max() > 1e-2, backend.name
