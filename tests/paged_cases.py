"""Shared test inputs: one step's queries, a paged K/V cache with shuffled blocks, its metadata."""
from __future__ import annotations

import torch

from batchinfer.engine.attention import AttentionMetadata


def paged_case(seed, head_dim, heads, kv_heads, block_size, query_lens, seq_lens,
               cache_dtype=torch.float32):
    """-> (q, key_cache, value_cache, meta) on the CPU; each sequence's blocks drawn at random."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    kc = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen).to(cache_dtype)
    vc = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen).to(cache_dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(order[used:used + n])
        used += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, torch.device("cpu"))
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen)
    return q, kc, vc, meta
