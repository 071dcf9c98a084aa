"""Portable paged attention in plain torch: the path on CUDA, and wherever the CPU kernel can't build.

A step's batch mixes decode rows (one new token) and prefill chunks (many new tokens, maybe after
a cached prefix). Looping over sequences in Python costs a dozen kernel launches per sequence per
layer, which on a GPU is the whole step (hybrid batching mixes the two kinds in most steps). So:
- decode rows (one new token each) go through batched calls: gather the rows' blocks, one SDPA
  with a length mask, the query heads that share a kv head passed as that head's queries
  (`decode_attention`, which CUDA graphs also capture);
- prefill chunks are grouped by size and each group is one padded SDPA with a causal-with-offset
  mask.
Both kinds are grouped the same way (`_group_rows`): a row joins a group only while the padding
stays a bounded share of the group's work, so one long sequence never pads out many short ones
(decode rows at ShareGPT's spread of contexts would otherwise all be gathered to the longest).
The grouping and every index tensor are worked out once per step (`plan`), not once per layer.
On CUDA a prefill group's K/V gather also repeats each kv head for its query heads, and SDPA is
held to the memory-efficient kernel: with a mask and grouped heads it would otherwise take
cuDNN's, whose host-side cost was ~0.8 ms a call on an H200 (most of a 512-sequence step), or
the math one.
A sliding window (a layer that sees only its last `window` keys) is one more term of the masks; a
logit soft-cap (Gemma 2: scores -> cap * tanh(scores / cap) before the softmax) and attention
sinks (GPT-OSS: a logit per head that joins the softmax's denominator and takes no value) take an
explicit softmax instead of SDPA, which has no such step.
`reference_attention` is the direct per-sequence definition the batched path is tested against.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

PAD_SLACK = 4096           # padded (query x key) elements a group may waste regardless of its size
PAD_RATIO = 2.0            # ... and beyond that, at most this many times its real elements
GROUP_DECODE_ROWS = True   # False: all decode rows in one call (the ablation, for benchmarks)
CUDA_SDPA = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def write_kv(key_cache, value_cache, k, v, meta) -> None:
    """Into the cache's own dtype (cache.kv_cache_dtype may store it narrower than the model)."""
    key_cache[meta.slot_blocks, :, meta.slot_offsets] = k.to(key_cache.dtype)
    value_cache[meta.slot_blocks, :, meta.slot_offsets] = v.to(value_cache.dtype)


@dataclass
class _Rows:
    """One batched call's sequences: where their queries sit in the flat batch and their K/V."""

    tokens: torch.Tensor          # long [n, q_max]: flat token index of each query (pads repeat
                                  # the chunk's last query; their outputs are dropped)
    keep: Optional[torch.Tensor]  # long [real queries]: positions in the [n * q_max] padded rows
    dest: Optional[torch.Tensor]  # long [real queries]: their flat token indices
    tables: torch.Tensor          # long [n, blocks]
    mask: torch.Tensor            # bool [n, 1, q_max, blocks * block_size]


@dataclass
class _Plan:
    decode: list[_Rows]
    prefill: list[_Rows]


class _Plans(dict):
    """A step's plans by sliding window (0: none): layers with the same window share one."""


def _group_rows(rows: list[int], query_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Rows sorted by size, cut into groups whose padded work stays within the bound."""
    groups: list[list[int]] = []
    current: list[int] = []
    real = s_max = 0
    for i in sorted(rows, key=lambda r: (query_lens[r], seq_lens[r])):  # q_len never falls
        cost = query_lens[i] * seq_lens[i]
        padded = (len(current) + 1) * query_lens[i] * max(s_max, seq_lens[i])
        if current and padded > PAD_RATIO * (real + cost) + PAD_SLACK:
            groups.append(current)
            current, real, s_max = [], 0, 0
        current.append(i)
        real, s_max = real + cost, max(s_max, seq_lens[i])
    if current:
        groups.append(current)
    return groups


def _rows(seqs: list[int], meta, offsets: list[int], block_size: int, device,
          window: int = 0) -> _Rows:
    q_lens = [meta.query_lens_cpu[i] for i in seqs]
    s_lens = [meta.seq_lens_cpu[i] for i in seqs]
    starts = [offsets[i] for i in seqs]
    q_max, s_max = max(q_lens), max(s_lens)
    n_blocks = -(-s_max // block_size)
    tokens = [[start + min(j, q_len - 1) for j in range(q_max)] for start, q_len in zip(starts, q_lens)]
    padded = any(q != q_max for q in q_lens)
    keep = [r * q_max + j for r, q_len in enumerate(q_lens) for j in range(q_len)] if padded else None
    dest = [start + j for start, q_len in zip(starts, q_lens) for j in range(q_len)] if padded else None
    index = torch.tensor(seqs, dtype=torch.long, device=device)
    long_ = {"dtype": torch.long, "device": device}
    ctx = torch.tensor([s - q for s, q in zip(s_lens, q_lens)], **long_)
    key_pos = torch.arange(n_blocks * block_size, **long_)
    query_pos = torch.arange(q_max, **long_)
    seq_lens = torch.tensor(s_lens, **long_)
    query_at = ctx[:, None, None] + query_pos[None, :, None]
    mask = ((key_pos[None, None, :] < seq_lens[:, None, None])
            & (key_pos[None, None, :] <= query_at))
    if window:
        mask &= key_pos[None, None, :] > query_at - window
    return _Rows(tokens=torch.tensor(tokens, **long_),
                 keep=None if keep is None else torch.tensor(keep, **long_),
                 dest=None if dest is None else torch.tensor(dest, **long_),
                 tables=meta.block_tables.index_select(0, index)[:, :n_blocks].long(),
                 mask=mask.unsqueeze(1))


def plan(meta, block_size: int, device, window: int = 0) -> _Plan:
    """The step's batched calls (cached on the metadata: every layer with this window shares
    them)."""
    if not isinstance(meta.backend_plan, _Plans):
        meta.backend_plan = _Plans()
    if window in meta.backend_plan:
        return meta.backend_plan[window]
    offsets = [0]
    for q_len in meta.query_lens_cpu:
        offsets.append(offsets[-1] + q_len)
    decodes = [i for i, q in enumerate(meta.query_lens_cpu) if q == 1]
    prefills = [i for i, q in enumerate(meta.query_lens_cpu) if q > 1]
    decode_groups = (_group_rows(decodes, meta.query_lens_cpu, meta.seq_lens_cpu)
                     if GROUP_DECODE_ROWS else [decodes] if decodes else [])
    meta.backend_plan[window] = _Plan(
        decode=[_rows(g, meta, offsets, block_size, device, window) for g in decode_groups],
        prefill=[_rows(g, meta, offsets, block_size, device, window)
                 for g in _group_rows(prefills, meta.query_lens_cpu, meta.seq_lens_cpu)])
    return meta.backend_plan[window]


@lru_cache(maxsize=None)
def _kv_head_of(num_heads: int, kv_heads: int, device: torch.device) -> torch.Tensor:
    return torch.arange(num_heads, device=device) // (num_heads // kv_heads)


def softcapped_attention(queries, k, v, mask, scale: float, softcap: float,
                         sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SDPA's maths with the logit soft-cap (0: none) before the softmax and, where `sinks` is
    given, a sink logit per head in its denominator (`sinks` broadcasts against the scores
    without their key axis: [heads, 1, 1], or [kv heads, group, 1] for grouped queries); k and
    v have the queries' heads or one per group of them (GQA: the queries' head axis a multiple
    of theirs)."""
    if k.shape[-3] != queries.shape[-3]:
        repeat = queries.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    scores = torch.matmul(queries, k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v)


def decode_attention(q, key_cache, value_cache, tables: torch.Tensor, mask: torch.Tensor,
                     scale: float, softcap: float = 0.0,
                     sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One new token per sequence: q [n, heads, dim] over the blocks of `tables` [n, W] (long),
    `mask` [n, 1, 1, W * block_size] -> [n, heads, dim]. The query heads that share a kv head go
    in as that head's queries (one token each, all under the same mask), so K/V are gathered once
    per kv head and never repeated. No host work: CUDA graphs capture it (cuda_graphs.py)."""
    n, num_heads, head_dim = q.shape
    kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    keys = tables.shape[1] * block_size
    k = key_cache[tables].transpose(1, 2).reshape(n, kv_heads, keys, head_dim).to(q.dtype)
    v = value_cache[tables].transpose(1, 2).reshape(n, kv_heads, keys, head_dim).to(q.dtype)
    queries = q.reshape(n, kv_heads, num_heads // kv_heads, head_dim)
    if softcap or sinks is not None:
        if sinks is not None:
            sinks = sinks.view(kv_heads, num_heads // kv_heads, 1)
        return softcapped_attention(queries, k, v, mask, scale, softcap,
                                    sinks).reshape(n, num_heads, head_dim)
    with sdpa_kernel(CUDA_SDPA) if q.is_cuda else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, scale=scale)
    return out.reshape(n, num_heads, head_dim)


def _attend_rows(q, key_cache, value_cache, rows: _Rows, scale: float, out: torch.Tensor,
                 softcap: float = 0.0, sinks: Optional[torch.Tensor] = None) -> None:
    n, q_max = rows.tokens.shape
    if q_max == 1:
        tokens = rows.tokens[:, 0]
        out.index_copy_(0, tokens, decode_attention(q[tokens], key_cache, value_cache, rows.tables,
                                                    rows.mask, scale, softcap, sinks))
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    keys = rows.tables.shape[1] * block_size
    queries = q[rows.tokens].transpose(1, 2)                         # [n, heads, q_max, dim]
    if softcap or sinks is not None:
        k = key_cache[rows.tables].transpose(1, 2).reshape(n, kv_heads, keys, head_dim).to(q.dtype)
        v = value_cache[rows.tables].transpose(1, 2).reshape(n, kv_heads, keys, head_dim).to(q.dtype)
        o = softcapped_attention(queries, k, v, rows.mask, scale, softcap,
                                 None if sinks is None else sinks.view(num_heads, 1, 1))
    elif q.is_cuda:
        index = (rows.tables[:, :, None], _kv_head_of(num_heads, kv_heads, q.device))
        k = key_cache[index].transpose(1, 2).reshape(n, num_heads, keys, head_dim).to(q.dtype)
        v = value_cache[index].transpose(1, 2).reshape(n, num_heads, keys, head_dim).to(q.dtype)
        with sdpa_kernel(CUDA_SDPA):
            o = F.scaled_dot_product_attention(queries, k, v, attn_mask=rows.mask, scale=scale)
    else:
        k = key_cache[rows.tables].transpose(1, 2).reshape(n, kv_heads, keys, head_dim).to(q.dtype)
        v = value_cache[rows.tables].transpose(1, 2).reshape(n, kv_heads, keys, head_dim).to(q.dtype)
        o = F.scaled_dot_product_attention(queries, k, v, attn_mask=rows.mask, scale=scale,
                                           enable_gqa=num_heads != kv_heads)
    o = o.transpose(1, 2).reshape(n * q_max, num_heads, head_dim)
    if rows.keep is None:
        out.index_copy_(0, rows.tokens.reshape(-1), o)
    else:
        out.index_copy_(0, rows.dest, o.index_select(0, rows.keep))


class TorchAttention:
    name = "torch"
    write_kv = staticmethod(write_kv)

    def attend(self, q, key_cache, value_cache, meta, scale: float, window: int = 0,
               softcap: float = 0.0, sinks: Optional[torch.Tensor] = None):
        """`window`: each query sees its last `window` keys only (0: all); `softcap`: the
        logit soft-cap (0: none); `sinks` [heads]: each head's sink logit in the softmax's
        denominator (None: none)."""
        step = plan(meta, key_cache.shape[2], q.device, window)
        out = torch.empty_like(q)
        for rows in step.decode + step.prefill:
            _attend_rows(q, key_cache, value_cache, rows, scale, out, softcap, sinks)
        return out


def reference_attention(q, key_cache, value_cache, meta, scale: float, window: int = 0,
                        softcap: float = 0.0, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One sequence at a time, straight from the definition (tests' reference)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        n_blocks = -(-s_len // block_size)
        blocks = meta.block_tables[i, :n_blocks].long()
        k = key_cache[blocks].transpose(0, 1).reshape(kv_heads, n_blocks * block_size, head_dim)
        v = value_cache[blocks].transpose(0, 1).reshape(kv_heads, n_blocks * block_size, head_dim)
        k, v = k[:, :s_len].to(q.dtype), v[:, :s_len].to(q.dtype)
        ctx = s_len - q_len
        key_at = torch.arange(s_len, device=q.device)[None, :]
        query_at = ctx + torch.arange(q_len, device=q.device)[:, None]
        allowed = (key_at <= query_at) & ((key_at > query_at - window) if window else True)
        qi = q[start:start + q_len].transpose(0, 1)
        if softcap or sinks is not None:
            oi = softcapped_attention(qi, k, v, allowed, scale, softcap,
                                      None if sinks is None else sinks.view(num_heads, 1, 1))
        else:
            oi = F.scaled_dot_product_attention(qi, k, v, attn_mask=allowed, scale=scale,
                                                enable_gqa=num_heads != kv_heads)
        out[start:start + q_len] = oi.transpose(0, 1)
        start += q_len
    return out
