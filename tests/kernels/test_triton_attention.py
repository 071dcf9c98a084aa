"""The Triton paged-attention kernel (the CUDA path) against the per-sequence definition.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) on CPU tensors; with one, on the GPU. Ragged batches mixing decode rows and prefill
chunks, prefixes already cached, block tables padded wider than a sequence, block sizes that do
not divide the tile, non-power-of-two head sizes, GQA groups of 1 to 8, and the CUDA graphs'
calling convention (static work list, padding rows on a reserved block).
"""
from __future__ import annotations

import logging

import pytest
import torch

from tests.triton_interpreter import DEVICE  # first: the interpreter's setup
from batchinfer.engine.attention import AttentionMetadata  # noqa: E402
from batchinfer.engine.torch_attention import reference_attention  # noqa: E402
from batchinfer.engine.triton_attention import (TritonAttention, launch,  # noqa: E402
                                                queries_per_program, step_work)
from tests.paged_cases import paged_case  # noqa: E402

# (kept short: the interpreter's time grows with every program and key tile)
MIXED = ([1, 1, 7, 40, 1, 33, 1, 90, 3], [1, 90, 7, 61, 17, 33, 130, 90, 9])
# prefix-cached prompts: a short chunk over a long cached context, a chunk ending on a block edge
CACHED = ([70, 5, 16, 1], [270, 133, 48, 64])
# one chunk longer than several programs' queries, decode rows at block edges (16, 32, 33)
LONG_CHUNK = ([100, 1, 1, 1], [100, 16, 32, 33])


def _on_device(q, kc, vc, meta):
    moved = AttentionMetadata.build(meta.query_lens_cpu, meta.seq_lens_cpu,
                                    meta.block_tables.tolist(), kc.shape[2], DEVICE)
    return q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), moved


def _check(q, kc, vc, meta, atol=2e-5):
    expected = reference_attention(q.float(), kc.float(), vc.float(), meta, 0.25)
    got = TritonAttention().attend(*_on_device(q, kc, vc, meta), 0.25)
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.float().cpu(), expected, rtol=atol, atol=atol)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,lens", [
    (9, 3, 16, 16, MIXED),
    (4, 4, 64, 5, MIXED),
    (8, 1, 32, 16, CACHED),
    (32, 8, 128, 16, LONG_CHUNK),
    (8, 2, 80, 7, CACHED),
    (6, 2, 16, 16, ([1] * 5, [1, 2, 63, 64, 65])),
], ids=["gqa3-mixed", "mha-block5", "mqa-cached", "llama-long-chunk", "dim80-cached",
        "decode-edges"])
def test_fp32_equals_the_per_sequence_definition(heads, kv_heads, head_dim, block_size, lens):
    _check(*paged_case(0, head_dim, heads, kv_heads, block_size, *lens))


@pytest.mark.parametrize("q_dtype,cache_dtype,atol", [
    (torch.bfloat16, torch.bfloat16, 3e-2),
    (torch.float16, torch.float16, 4e-3),
    (torch.float32, torch.bfloat16, 2e-5),   # a narrow cache under an fp32 model
])
def test_narrow_dtypes(q_dtype, cache_dtype, atol):
    q, kc, vc, meta = paged_case(1, 64, 8, 2, 16, *MIXED, cache_dtype=cache_dtype)
    _check(q.to(q_dtype), kc, vc, meta, atol)


def test_a_block_table_wider_than_the_sequence_is_not_read_past_its_length():
    """Entries past a sequence's blocks point at a block of NaNs: nothing of it may leak in."""
    q, kc, vc, meta = paged_case(2, 16, 4, 2, 16, [1, 9], [20, 40])
    poison = kc.shape[0]
    kc = torch.cat([kc, torch.full_like(kc[:1], float("nan"))])
    vc = torch.cat([vc, torch.full_like(vc[:1], float("nan"))])
    tables = [row[:-(-s // 16)] + [poison] * 3 for row, s in zip(meta.block_tables.tolist(),
                                                                meta.seq_lens_cpu)]
    wide = AttentionMetadata.build(meta.query_lens_cpu, meta.seq_lens_cpu, tables, 16,
                                   torch.device("cpu"))
    _check(q, kc, vc, wide)


def test_the_graph_calling_convention_skips_padding_rows_and_padded_widths():
    """As cuda_graphs.py launches it: one query per row, a static work list, long lengths, and
    padding rows of length 1 on a reserved block; real rows equal the eager kernel's."""
    q, kc, vc, meta = paged_case(3, 32, 8, 2, 16, [1, 1, 1], [5, 47, 33])
    q, kc, vc, dev_meta = _on_device(q, kc, vc, meta)
    expected = TritonAttention().attend(q, kc, vc, dev_meta, 0.25)
    batch, width, pad_block = 8, 6, 0
    tables = torch.full((batch, width), pad_block, dtype=torch.long, device=DEVICE)
    tables[:3, :dev_meta.block_tables.shape[1]] = dev_meta.block_tables
    seq_lens = torch.ones(batch, dtype=torch.long, device=DEVICE)
    seq_lens[:3] = dev_meta.seq_lens
    rows = torch.arange(batch, device=DEVICE)
    work = torch.stack([rows, torch.zeros_like(rows)], 1).to(torch.int32)
    query_start = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    padded_q = torch.cat([q, torch.randn(batch - 3, *q.shape[1:], device=DEVICE)])
    out = torch.empty_like(padded_q)
    launch(out, padded_q, kc, vc, tables, seq_lens, query_start, work, batch, True, 0.25)
    torch.testing.assert_close(out[:3], expected, rtol=0, atol=0)
    assert torch.isfinite(out).all()


def test_the_work_list_is_built_once_per_step_and_covers_every_query():
    q, kc, vc, meta = paged_case(4, 16, 8, 2, 16, *LONG_CHUNK)
    work = step_work(meta, 4, torch.device("cpu"))
    assert step_work(meta, 4, torch.device("cpu")) is work
    queries, rows = queries_per_program(4, decode=False)
    assert (queries, rows) == (16, 64) and queries_per_program(3, decode=True) == (1, 16)
    assert work.decode_programs == 3 and work.prefill_programs == -(-100 // queries)
    assert work.work[:3, 0].tolist() == [1, 2, 3]
    assert work.work[3:, 1].tolist() == list(range(0, 100, queries))


def test_a_head_size_the_kernel_cannot_take_falls_back_to_torch_with_one_warning(caplog):
    q, kc, vc, meta = paged_case(5, 320, 2, 1, 16, [3, 1], [3, 9])
    backend = TritonAttention()
    with caplog.at_level(logging.WARNING, logger="batchinfer.engine.triton_attention"):
        first = backend.attend(q, kc, vc, meta, 0.25)
        backend.attend(q, kc, vc, meta, 0.25)
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "head size 320" in caplog.records[0].getMessage()
    torch.testing.assert_close(first, reference_attention(q, kc, vc, meta, 0.25))


def test_the_engine_gives_the_torch_paths_tokens_through_the_kernel_and_its_graphs(make_engine):
    """The embedded SmolLM2's first 2 layers (fp32, chunked prefill mixing with decode; the
    interpreter takes ~1 s a step for all 30): greedy tokens with the
    kernel as the engine's attention and triton_ops.py's element-wise kernels, then with decode steps through the graphs' padded forward
    (run eagerly, capture=False: capture itself needs a GPU), equal the torch path's."""
    from batchinfer.engine.cuda_graphs import DecodeGraphs
    from batchinfer.engine.triton_ops import TritonOps
    from tests.greedy import greedy_tokens

    engine = make_engine(model={"max_model_len": 512, "dtype": "float32",
                                "hf_overrides": {"num_hidden_layers": 2}},
                         device={"device": "cpu", "attention_backend": "torch"},
                         scheduler={"policy": "hb", "max_num_batched_tokens": 64,
                                    "chunk_size": 32})
    executor = engine.replicas[0].executor
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 49000, (n,), generator=gen).tolist() for n in (1, 6, 70)]
    expected = greedy_tokens(engine, prompts, batched=True, max_new=4)
    executor.backend = TritonAttention()
    executor.model.use_ops(TritonOps)            # with the Triton element-wise ops, as on CUDA
    assert greedy_tokens(engine, prompts, batched=True, max_new=4) == expected
    graphs = DecodeGraphs(executor.model, executor.kv_caches, executor.block_manager,
                          torch.device("cpu"), max_batch=8, max_seq_len_to_capture=512,
                          capture=False, triton_attention=True)
    executor.graphs = graphs
    assert greedy_tokens(engine, prompts, batched=True, max_new=4) == expected
    assert graphs.steps >= 2


def test_cuda_takes_the_kernel_unless_the_model_is_one_it_cannot_take(caplog):
    """Decided when the engine is built, so eager steps and CUDA graphs agree (no GPU needed:
    choosing touches no device)."""
    from types import SimpleNamespace

    from batchinfer.engine.attention import select_backend

    cuda = torch.device("cuda")
    llama = SimpleNamespace(head_dim=128, num_heads=32, num_kv_heads=8)
    assert select_backend("auto", cuda, torch.bfloat16, llama).name == "triton"
    wide = SimpleNamespace(head_dim=320, num_heads=8, num_kv_heads=8)
    with caplog.at_level(logging.WARNING, logger="batchinfer.engine.attention"):
        assert select_backend("auto", cuda, torch.bfloat16, wide).name == "torch"
        assert select_backend("triton", cuda, torch.bfloat16, wide).name == "torch"
    assert [r.getMessage() for r in caplog.records][0].count("head size 320") == 1
    from batchinfer.engine.errors import ConfigError

    with pytest.raises(ConfigError, match="device.attention_backend: triton needs device cuda"):
        select_backend("triton", torch.device("cpu"), torch.float32)
