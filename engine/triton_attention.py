"""Paged attention in Triton: the CUDA path's kernel, reading K/V through the block table in place.

One kernel serves decode rows and prefill chunks (over a cached prefix too). A program owns one
kv head of one sequence and a run of that sequence's queries; its rows are those queries times
the query heads that share the kv head (GQA: K/V are read once for the whole group). It walks
the sequence's keys a tile at a time, looking each key's block up in the block table, with an
online softmax in fp32, so nothing is gathered and no padding is read: a program stops at the
last key its queries can see. A step launches it twice, once for the decode rows (one query per
program) and once for the prefill chunks (QUERY_ROWS rows per program), over a work list of
(sequence, first query) pairs built once per step and shared by every layer.

fp32 models use IEEE fp32 products (not TF32), so fp32 runs stay token-exact against transformers;
bf16 / fp16 models multiply in their dtype (the probabilities rounded to it before P x V, as
flash attention does) and accumulate in fp32. A sliding-window layer's programs start at the
first key their queries' windows reach and mask below each one's window; a logit soft-cap
(Gemma 2) caps the scores before the online softmax; attention sinks (GPT-OSS: a logit per head)
join each row's denominator after the last tile. All three are compile-time switches (WINDOWED,
SOFTCAP, SINKS), so the plain causal kernel is the code it was.
CI has no GPU: the tests run this kernel in Triton's interpreter (TRITON_INTERPRET=1) on CPU
tensors against the per-sequence definition (torch_attention.reference_attention).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .host_to_device import to_device
from .torch_attention import TorchAttention, write_kv

log = logging.getLogger(__name__)

QUERY_ROWS = 64          # rows (queries x heads of a kv group) a prefill program works on
KEY_TILE = 64            # keys per iteration (half for rows over 256 bytes: fp32 heads of 128+,
                         # whose K and V tiles would outgrow shared memory)
MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr, query_start_ptr,
        work_ptr, sinks_ptr, scale_log2, window,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_table,
        GROUP: tl.constexpr, QUERIES: tl.constexpr, ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr, FP32_DOT: tl.constexpr, WINDOWED: tl.constexpr,
        SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(work_ptr + 2 * pid).to(tl.int64)
    first = tl.load(work_ptr + 2 * pid + 1)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len                       # cached keys before the first query

    r = tl.arange(0, ROWS)
    query = first + r // GROUP                  # query index inside the sequence's chunk
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < QUERIES * GROUP) & (query < q_len)
    d = tl.arange(0, DIM_P2)
    d_ok = d < HEAD_DIM
    token = (q_start + query).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # a finite floor, so a row that sees nothing in a tile gets exp2(-inf) = 0, never NaN
    m = tl.full([ROWS], -1.0e30, tl.float32)
    denom = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM_P2], tl.float32)
    last = ctx + tl.minimum(first + QUERIES, q_len)   # keys [0, last) are visible to some row
    lowest = 0
    if WINDOWED:    # the first query's window starts here; tiles wholly before it are skipped
        lowest = tl.maximum(ctx + first + 1 - window, 0) // TILE * TILE
    for start in range(lowest, last, TILE):
        pos = start + tl.arange(0, TILE)
        pos_ok = pos < last
        block = tl.load(tables_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=pos_ok,
                        other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k = tl.load(k_cache_ptr + (block * stride_kb + kv_head * stride_kh + slot * stride_kt)[None, :]
                    + d[:, None], mask=pos_ok[None, :] & d_ok[:, None], other=0.0)
        if FP32_DOT:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        if SOFTCAP > 0.0:   # cap * tanh(scores / cap), tanh(x) = 1 - 2 / (e^2x + 1); log2 units
            x = s * (scale_log2 / (1.4426950408889634 * SOFTCAP))
            s = (1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)) * (
                SOFTCAP * 1.4426950408889634)
        else:
            s = s * scale_log2
        visible = pos_ok[None, :] & (pos[None, :] <= ctx + query[:, None])
        if WINDOWED:
            visible = visible & (pos[None, :] > ctx + query[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + (block * stride_vb + kv_head * stride_vh + slot * stride_vt)[:, None]
                    + d[None, :], mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m = m_new
    if SINKS:   # the head's sink logit joins the denominator (log2 units, as m)
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        denom += tl.math.exp2(tl.where(row_ok, sink * 1.4426950408889634 - m, float("-inf")))
    denom = tl.where(denom > 0.0, denom, 1.0)
    out = acc / denom[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# Triton's CPU interpreter (the tests; read once: it must be set before triton is imported): its
# tl.dot misreads bf16 operands, so products are taken in fp32 there; on a GPU a bf16 / fp16
# model multiplies in its own dtype
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def queries_per_program(group: int, decode: bool) -> tuple[int, int]:
    """(queries, rows) of one program: decode rows take one query; prefill programs fill
    QUERY_ROWS rows. Rows are at least 16 (tl.dot's smallest tile)."""
    queries = 1 if decode else max(1, QUERY_ROWS // group)
    return queries, max(16, _next_pow2(queries * group))


def launch(out, q, key_cache, value_cache, tables, seq_lens, query_start, work, programs: int,
           decode: bool, scale: float, window: int = 0, softcap: float = 0.0,
           sinks=None) -> None:
    """Runs the kernel over `programs` (sequence, first query) pairs of `work` (int32 [P, 2]).
    tables [B, W] and seq_lens [B] any integer dtype; query_start [B + 1]. `window` > 0: a
    sliding window of that many keys; `softcap` > 0: the logit soft-cap; `sinks` [heads]: each
    head's sink logit in the softmax's denominator."""
    if programs == 0:
        return
    _, num_heads, head_dim = q.shape
    kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // kv_heads
    queries, rows = queries_per_program(group, decode)
    _paged_attention_kernel[(programs, kv_heads)](
        out, q, key_cache, value_cache, tables, seq_lens, query_start, work,
        q if sinks is None else sinks, scale * _LOG2E, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), tables.stride(0),
        GROUP=group, QUERIES=queries, ROWS=rows, HEAD_DIM=head_dim,
        DIM_P2=max(16, _next_pow2(head_dim)), BLOCK_SIZE=block_size,
        TILE=KEY_TILE if head_dim * q.element_size() <= 256 else KEY_TILE // 2,
        FP32_DOT=q.dtype == torch.float32 or INTERPRETING, WINDOWED=window > 0,
        SOFTCAP=float(softcap), SINKS=sinks is not None,
        num_warps=4, num_stages=2)


@dataclass
class StepWork:
    """One step's programs: decode pairs first, then prefill pairs, in one int32 tensor."""

    work: torch.Tensor
    decode_programs: int
    prefill_programs: int


def step_work(meta, group: int, device) -> StepWork:
    """The step's (sequence, first query) pairs (cached on the metadata: every layer shares them)."""
    if isinstance(meta.backend_plan, StepWork):
        return meta.backend_plan
    queries, _ = queries_per_program(group, decode=False)
    decode = [(i, 0) for i, q in enumerate(meta.query_lens_cpu) if q == 1]
    prefill = [(i, first) for i, q in enumerate(meta.query_lens_cpu) if q > 1
               for first in range(0, q, queries)]
    pairs = decode + prefill or [(0, 0)]
    work = to_device(torch.tensor(pairs, dtype=torch.int32), device)
    meta.backend_plan = StepWork(work, len(decode), len(prefill))
    return meta.backend_plan


def unsupported_reason(head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype,
                       kv_dtype: torch.dtype) -> str:
    """Why the kernel can't take this model ('' when it can)."""
    if dtype not in DTYPES or kv_dtype not in DTYPES:
        return f"dtype {dtype} / K/V cache {kv_dtype} (the kernel takes fp32, bf16, fp16)"
    if head_dim > MAX_HEAD_DIM:
        return f"head size {head_dim} (the kernel takes up to {MAX_HEAD_DIM})"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads over {num_kv_heads} kv heads"
    return ""


class TritonAttention:
    """The CUDA default: this module's kernel. select_backend refuses it up front for a model it
    can't take (attention.py); shapes or dtypes that still reach it go through the portable
    torch path, with one warning that says why."""

    name = "triton"
    write_kv = staticmethod(write_kv)

    def __init__(self):
        self._fallback = None

    def attend(self, q, key_cache, value_cache, meta, scale: float, window: int = 0,
               softcap: float = 0.0, sinks=None):
        if self._fallback is None:
            reason = unsupported_reason(q.shape[-1], q.shape[1], key_cache.shape[1], q.dtype,
                                        key_cache.dtype)
            if reason:
                log.warning("Triton paged attention can't take %s: using the portable torch path",
                            reason)
            self._fallback = TorchAttention() if reason else False
        if self._fallback:
            return self._fallback.attend(q, key_cache, value_cache, meta, scale, window, softcap,
                                         sinks)
        if window and max(meta.seq_lens_cpu, default=0) <= window:
            window = 0                                  # no sequence is longer: plain causal
        group = q.shape[1] // key_cache.shape[1]
        step = step_work(meta, group, q.device)
        out = torch.empty_like(q)
        args = (key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start)
        launch(out, q, *args, step.work, step.decode_programs, True, scale, window, softcap, sinks)
        launch(out, q, *args, step.work[step.decode_programs:], step.prefill_programs, False, scale,
               window, softcap, sinks)
        return out
