"""The native CPU paged-attention kernel against the portable torch path (and a direct softmax)."""
from __future__ import annotations

import itertools

import pytest
import torch

from batchinfer.engine.attention import AttentionMetadata, NativeCPUAttention, TorchAttention
from batchinfer.engine.kernels import load_native_kernels
from tests.paged_cases import paged_case as _case

pytestmark = pytest.mark.skipif(not load_native_kernels(), reason="native kernel did not build")


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 8), (16, 4, 2), (48, 6, 2)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_native_matches_torch(head_dim, heads, kv_heads, block_size):
    query_lens = [1, 1, 7, 40, 1, 33, 16]
    seq_lens = [1, 90, 7, 61, 17, 33, 200]
    q, kc, vc, meta = _case(0, head_dim, heads, kv_heads, block_size, query_lens, seq_lens)
    scale = head_dim ** -0.5
    expected = TorchAttention().attend(q, kc, vc, meta, scale)
    got = NativeCPUAttention().attend(q, kc, vc, meta, scale)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_decode_against_direct_softmax():
    q, kc, vc, meta = _case(1, 64, 9, 3, 16, [1, 1], [37, 16])
    got = NativeCPUAttention().attend(q, kc, vc, meta, 0.125)
    for i, s_len in enumerate([37, 16]):
        blocks = meta.block_tables[i, : -(-s_len // 16)].long()
        k = kc[blocks].transpose(0, 1).reshape(3, -1, 64)[:, :s_len]
        v = vc[blocks].transpose(0, 1).reshape(3, -1, 64)[:, :s_len]
        for h in range(9):
            scores = (q[i, h] @ k[h // 3].T) * 0.125
            expected = torch.softmax(scores, -1) @ v[h // 3]
            torch.testing.assert_close(got[i, h], expected, rtol=1e-4, atol=1e-5)


def test_large_scores_stay_finite():
    q, kc, vc, meta = _case(2, 64, 4, 2, 16, [3, 1], [50, 90])
    got = NativeCPUAttention().attend(q * 200, kc, vc, meta, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, TorchAttention().attend(q * 200, kc, vc, meta, 0.125),
                               rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 2)])
@pytest.mark.parametrize("block_size", [16, 8, 32])
def test_decode_batch_in_physical_block_order(head_dim, heads, kv_heads, block_size):
    """The decode path visits blocks in physical order across sequences: interleaved (lockstep)
    block tables, a block shared by two sequences (prefix caching) and a thread count that
    splits the batch must all give the per-sequence answer. Blocks of 8 and 32: the AVX-512
    lanes' 16-token chunks half-filled and two to a block."""
    gen = torch.Generator().manual_seed(3)
    num_seqs = 37
    seq_lens = torch.randint(1, 300, (num_seqs,), generator=gen).tolist()
    width = max(-(-s // block_size) for s in seq_lens)
    # block b of sequence i at b * num_seqs + i, as an allocator serving a batch in lockstep does
    tables = [[b * num_seqs + i for b in range(-(-s // block_size))] for i, s in enumerate(seq_lens)]
    tables[5][0] = tables[4][0]  # a shared prefix block
    num_blocks = width * num_seqs
    kc = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen)
    vc = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen)
    meta = AttentionMetadata.build([1] * num_seqs, seq_lens, tables, block_size, torch.device("cpu"))
    q = torch.randn(num_seqs, heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    expected = TorchAttention().attend(q, kc, vc, meta, scale)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got = NativeCPUAttention().attend(q, kc, vc, meta, scale)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 2)])
def test_outputs_do_not_depend_on_where_the_blocks_are(cache_dtype, head_dim, heads, kv_heads):
    """The same sequences (the same keys and values at the same positions) in blocks laid out in
    lockstep, and shuffled across the cache: decode rows and prefill chunks give the same bits,
    at 1-3 threads. A bf16 model's greedy replies otherwise change with the free list's order."""
    gen = torch.Generator().manual_seed(13)
    block_size, num_seqs = 16, 11
    query_lens = [1] * 8 + [5, 17, 40]
    seq_lens = torch.randint(40, 200, (num_seqs,), generator=gen).tolist()
    counts = [-(-s // block_size) for s in seq_lens]
    width = max(counts)
    lockstep = [[b * num_seqs + i for b in range(c)] for i, c in enumerate(counts)]
    ids = torch.randperm(width * num_seqs, generator=gen).tolist()
    shuffled = [[ids[t] for t in table] for table in lockstep]
    keys = torch.randn(width * num_seqs, kv_heads, block_size, head_dim, generator=gen).to(cache_dtype)
    values = torch.randn(width * num_seqs, kv_heads, block_size, head_dim, generator=gen).to(cache_dtype)
    moved_k, moved_v = torch.empty_like(keys), torch.empty_like(values)
    for before, after in zip(lockstep, shuffled):
        moved_k[after], moved_v[after] = keys[before], values[before]
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs = [NativeCPUAttention().attend(q, k, v, AttentionMetadata.build(
                        query_lens, seq_lens, tables, block_size, torch.device("cpu")), head_dim ** -0.5)
                    for k, v, tables in ((keys, values, lockstep), (moved_k, moved_v, shuffled))]
            assert torch.equal(outs[0], outs[1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("block_size", [8, 16, 24])
def test_decode_over_a_narrow_cache_with_blocks_in_any_order(block_size):
    """Decode rows over a bf16 cache (bf16 dot products where the CPU has AVX512-BF16 and no AMX)
    with every sequence's blocks shuffled across the cache, so a block's neighbours in the
    sequence are visited before and after it, and block sizes that are not a multiple of 16:
    each block writes only its own scores."""
    gen = torch.Generator().manual_seed(11)
    num_seqs, heads, kv_heads, head_dim = 9, 9, 3, 64
    seq_lens = torch.randint(1, 120, (num_seqs,), generator=gen).tolist()
    counts = [-(-s // block_size) for s in seq_lens]
    ids = torch.randperm(sum(counts), generator=gen).tolist()
    tables = [ids[sum(counts[:i]):sum(counts[:i + 1])] for i in range(num_seqs)]
    kc = torch.randn(sum(counts), kv_heads, block_size, head_dim, generator=gen).to(torch.bfloat16)
    vc = torch.randn(sum(counts), kv_heads, block_size, head_dim, generator=gen).to(torch.bfloat16)
    meta = AttentionMetadata.build([1] * num_seqs, seq_lens, tables, block_size, torch.device("cpu"))
    q = torch.randn(num_seqs, heads, head_dim, generator=gen)
    got = NativeCPUAttention().attend(q, kc, vc, meta, 0.125)
    expected = TorchAttention().attend(q, kc.float(), vc.float(), meta, 0.125)
    torch.testing.assert_close(got, expected, rtol=0, atol=8e-3)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,heads,kv_heads,block_size", [(64, 9, 3, 16), (128, 8, 2, 16),
                                                                 (48, 6, 2, 5)])
def test_narrow_cache_reads_exactly_the_widened_values(cache_dtype, head_dim, heads, kv_heads, block_size):
    """A bf16 / fp16 cache (cache.kv_cache_dtype) is widened to float32 on load and all arithmetic
    stays float32: the AVX2 kernels (head sizes 64, 128) give the same bits as over the cache cast
    down and back up; the generic one (48) the same values up to float32 summation order.
    Decode rows and prefill chunks both. The exception: over a bf16 cache on a CPU with
    AVX512-BF16 and no AMX, decode rows and prefill chunks run bf16 dot products (the query and
    the softmax weights rounded to bf16), within bf16's rounding of the fp32 answer."""
    query_lens = [1, 1, 7, 40, 1, 33]
    seq_lens = [1, 90, 7, 61, 17, 200]
    q, kc, vc, meta = _case(4, head_dim, heads, kv_heads, block_size, query_lens, seq_lens)
    narrow_k, narrow_v = kc.to(cache_dtype), vc.to(cache_dtype)
    scale = head_dim ** -0.5
    got = NativeCPUAttention().attend(q, narrow_k, narrow_v, meta, scale)
    expected = NativeCPUAttention().attend(q, narrow_k.float(), narrow_v.float(), meta, scale)
    bf16_dot = (cache_dtype == torch.bfloat16 and head_dim in (64, 128)
                and torch.ops.batchinfer.bf16_decode_attention() == "avx512_bf16")
    if bf16_dot:
        starts = [0, *itertools.accumulate(query_lens)][:-1]
        decode = [start for start, count in zip(starts, query_lens) if count == 1]
        prefill = [row for row in range(got.shape[0]) if row not in decode]
        torch.testing.assert_close(got, expected, rtol=0, atol=8e-3)
        for rows in (decode, prefill):   # both bf16 paths ran
            assert not torch.equal(got[rows], expected[rows])
    elif head_dim in (64, 128):
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(TorchAttention().attend(q, narrow_k, narrow_v, meta, scale), expected,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_rounds_like_torch(cache_dtype):
    """The native write into a narrow cache rounds as torch's cast does (to nearest even)."""
    gen = torch.Generator().manual_seed(5)
    meta = AttentionMetadata.build([3, 1], [3, 18], [[2], [0, 1]], 16, torch.device("cpu"))
    k, v = torch.randn(4, 3, 64, generator=gen), torch.randn(4, 3, 64, generator=gen)
    caches = [[torch.zeros(3, 3, 16, 64, dtype=cache_dtype) for _ in range(2)] for _ in range(2)]
    NativeCPUAttention.write_kv(*caches[0], k, v, meta)
    TorchAttention.write_kv(*caches[1], k, v, meta)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(caches[0][0][1, :, 1], k[3].to(cache_dtype))   # position 17 of the second


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 2), (64, 4, 4), (128, 8, 1),
                                                    (64, 14, 2)])
@pytest.mark.parametrize("block_size", [16, 8, 24, 32, 5])
def test_prefill_against_direct_softmax(cache_dtype, head_dim, heads, kv_heads, block_size):
    """Prefill chunks (over a bf16 cache on CPUs with AVX512-BF16 and no AMX, bf16 dot products;
    fp32 arithmetic elsewhere) against a causal softmax over the cached prefix:
    chunks of 1-40 queries from a fresh start and over cached prefixes, across the 16-query tiles
    and the 16-key slices, blocks shuffled, at 1-3 threads. Every slot past a sequence's length is
    NaN, as a reused block's leftovers may be: none may reach an output. The bf16 path is held to
    the softmax of its own bf16-rounded query, within its rounding of the weights."""
    query_lens = [40, 17, 16, 3, 33, 1, 25]
    seq_lens = [40, 17, 90, 3, 61, 200, 150]
    q, kc, vc, meta = _case(7, head_dim, heads, kv_heads, block_size, query_lens, seq_lens)
    kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    scale = head_dim ** -0.5
    bf16_dot = (cache_dtype == torch.bfloat16
                and torch.ops.batchinfer.bf16_decode_attention() == "avx512_bf16")
    q_seen = (q * scale).to(torch.bfloat16).float() / scale if bf16_dot else q
    tables = meta.block_tables
    group = heads // kv_heads
    expected = []
    for i, (nq, s_len) in enumerate(zip(query_lens, seq_lens)):
        blocks = tables[i, : -(-s_len // block_size)].long()
        last, used = blocks[-1], s_len - (len(blocks) - 1) * block_size
        kc[last, :, used:] = float("nan")
        vc[last, :, used:] = float("nan")
        k = kc[blocks].float().transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :s_len]
        v = vc[blocks].float().transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :s_len]
        start = sum(query_lens[:i])
        for j in range(nq):
            pos = s_len - nq + j
            heads_out = []
            for h in range(heads):
                scores = (q_seen[start + j, h] @ k[h // group, : pos + 1].T) * scale
                heads_out.append(torch.softmax(scores, -1) @ v[h // group, : pos + 1])
            expected.append(torch.stack(heads_out))
    expected = torch.stack(expected)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got = NativeCPUAttention().attend(q, kc, vc, meta, scale)
            assert torch.isfinite(got).all()
            if bf16_dot:
                torch.testing.assert_close(got, expected, rtol=0, atol=6e-3)
            else:
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    finally:
        torch.set_num_threads(threads)
