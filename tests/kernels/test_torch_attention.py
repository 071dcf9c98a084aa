"""The batched portable attention (the CUDA path) against the per-sequence definition."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine.torch_attention import (PAD_RATIO, PAD_SLACK, TorchAttention,
                                               _group_rows, plan, reference_attention)
from tests.paged_cases import paged_case


MIXED = ([1, 1, 7, 40, 1, 33, 16, 1, 250, 3], [1, 90, 7, 61, 17, 33, 200, 300, 250, 9])
# decode rows of mostly short contexts and a few long ones (as ShareGPT's): several groups
SPREAD = ([1] * 40, [17 + (i * 37) % 300 for i in range(36)] + [4000, 4500, 4800, 5000])


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("lens", [MIXED, ([1] * 6, [5, 80, 1, 33, 16, 17]), ([12, 5], [12, 40]),
                                  SPREAD], ids=["mixed", "decode-only", "prefill-only", "spread"])
def test_batched_equals_one_sequence_at_a_time(heads, kv_heads, block_size, lens):
    q, kc, vc, meta = paged_case(0, 16, heads, kv_heads, block_size, *lens)
    got = TorchAttention().attend(q, kc, vc, meta, 0.25)
    torch.testing.assert_close(got, reference_attention(q, kc, vc, meta, 0.25),
                               rtol=1e-5, atol=1e-6)


def test_a_narrow_cache_is_read_in_the_query_dtype():
    q, kc, vc, meta = paged_case(1, 16, 8, 2, 16, *MIXED, cache_dtype=torch.bfloat16)
    got = TorchAttention().attend(q, kc, vc, meta, 0.25)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference_attention(q, kc, vc, meta, 0.25),
                               rtol=1e-5, atol=1e-6)


def test_the_plan_is_worked_out_once_per_step():
    q, kc, vc, meta = paged_case(2, 16, 4, 2, 16, *MIXED)
    first = plan(meta, 16, q.device)
    assert plan(meta, 16, q.device) is first
    assert [rows.tokens.shape for rows in first.decode] == [(4, 1)]
    assert sum(g.tokens.shape[0] for g in first.prefill) == 6


def test_decode_rows_of_spread_lengths_are_gathered_in_groups():
    q, kc, vc, meta = paged_case(3, 16, 4, 2, 16, *SPREAD)
    groups = plan(meta, 16, q.device).decode
    assert len(groups) > 1 and sum(g.tokens.shape[0] for g in groups) == 40
    gathered = sum(g.tables.numel() for g in groups) * 16
    assert gathered <= PAD_RATIO * sum(SPREAD[1]) + len(groups) * PAD_SLACK


def test_a_long_chunk_is_not_padded_out_by_short_ones():
    query_lens = [2048] + [3] * 50
    seq_lens = [4096] + [40] * 50
    groups = _group_rows(list(range(51)), query_lens, seq_lens)
    assert [0] in groups and sum(len(g) for g in groups) == 51


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(2, 300), st.integers(0, 500)), min_size=1, max_size=40))
def test_groups_cover_every_chunk_once_within_the_padding_bound(chunks):
    query_lens = [q for q, _ in chunks]
    seq_lens = [q + ctx for q, ctx in chunks]
    groups = _group_rows(list(range(len(chunks))), query_lens, seq_lens)
    assert sorted(i for g in groups for i in g) == list(range(len(chunks)))
    for g in groups:
        real = sum(query_lens[i] * seq_lens[i] for i in g)
        padded = len(g) * max(query_lens[i] for i in g) * max(seq_lens[i] for i in g)
        assert len(g) == 1 or padded <= PAD_RATIO * real + PAD_SLACK
