"""Shared test inputs: one step's queries, a paged K/V cache with shuffled blocks, its metadata;
the CPU attention kernels' cases (sliding windows, soft-caps, sinks) and backends."""
from __future__ import annotations

import torch

from batchinfer.engine.attention import AttentionMetadata

# (query_lens, seq_lens): decode rows and prefill chunks over cached prefixes, most of them far
# past the windows below
MIXED = ([1, 1, 7, 40, 1, 33, 1, 3], [1, 90, 7, 61, 17, 100, 130, 70])
# name: (heads, kv_heads, head_dim, block_size, window, softcap); the "sinks" ones are
# test_attention_sinks.py's, the others test_attention_windows.py's
KERNEL_CASES = {
    "window-5-block-16": (4, 2, 64, 16, 5, 0.0),
    "window-16-on-the-block-edge": (8, 2, 128, 16, 16, 0.0),
    "window-37-dim-48": (6, 3, 48, 8, 37, 0.0),
    "softcap-only": (4, 1, 64, 16, 0, 0.5),
    "window-and-softcap": (4, 2, 64, 16, 24, 0.3),
    "sinks": (4, 2, 64, 16, 0, 0.0),
    "sinks-dim-128-gqa-4": (8, 2, 128, 16, 0, 0.0),
    "sinks-dim-48": (6, 3, 48, 8, 0, 0.0),
    "sinks-window-16": (4, 2, 64, 16, 16, 0.0),
    "sinks-window-and-softcap": (4, 1, 64, 16, 24, 0.3),
}


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


def kernel_case(name, seed=3):
    """KERNEL_CASES[name] over MIXED -> (q, key_cache, value_cache, meta, window, softcap), the
    queries times 4: sharper scores, so that windows, caps and sinks move the output."""
    heads, kv_heads, head_dim, block_size, window, softcap = KERNEL_CASES[name]
    q, kc, vc, meta = paged_case(seed, head_dim, heads, kv_heads, block_size, *MIXED)
    return q * 4, kc, vc, meta, window, softcap


def cpu_backends():
    """The CPU attention backends: the torch path, and the native kernel where it is built."""
    from batchinfer.engine.attention import NativeCPUAttention, TorchAttention
    from batchinfer.engine.kernels import load_native_kernels

    return [TorchAttention()] + ([NativeCPUAttention()] if load_native_kernels() else [])
