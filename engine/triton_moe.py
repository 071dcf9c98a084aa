"""A mixture of experts' expert computation as two grouped GEMM kernels, for CUDA.

fused_experts.StackedExperts runs one GEMM chain per expert that got tokens, which needs each
expert's token count on the host: a device-to-host sync and ~4 kernel launches per expert per
layer. Qwen3-30B-A3B has 128 experts in each of 48 layers, so a decode step launched ~25,000
kernels and waited on the GPU 48 times. Here the (token, slot) pairs are grouped by expert on
the device (`group_by_expert`: each expert's run padded to whole BLOCK_M-row tiles, with no host
read), and one kernel launch per projection covers every expert (vLLM's fused_moe layout): a
program takes one tile of one expert's rows and one tile of the projection's outputs, gathers
its rows' inputs, multiplies by that expert's weights and writes the rows back at their pairs'
places. The gate/up projection's bias, the activation between the two (SiLU-and-mul, or
GPT-OSS's clamped SwiGLU, as torch ops over all pairs) and the down projection's bias and
routing weight are applied on the way; the k pairs of a token are summed at the end.

fp32 operands multiply in IEEE fp32 (not TF32), so fp32 models keep transformers' tokens.
CI runs the kernel in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter misreads bf16 operands of tl.dot (as triton_attention.py notes)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _expert_gemm_kernel(a_ptr, w_ptr, bias_ptr, route_ptr, out_ptr, pairs_ptr, tile_expert_ptr,
                        num_pairs, N, K, top_k,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GATHER_TOKENS: tl.constexpr, HAS_BIAS: tl.constexpr,
                        SCALE_ROWS: tl.constexpr, FP32_DOT: tl.constexpr):
    """out[pair, n] = (a[row] . w[expert, n, :] + bias[expert, n]) * route[pair] for the
    BLOCK_M pairs of tile program_id(0) (all of one expert) and the BLOCK_N outputs of
    program_id(1); row = pair // top_k (the pair's token) where GATHER_TOKENS, else the pair."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert < 0:          # a tile past the last expert's run: nothing to do
        return
    pairs = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair_ok = pairs < num_pairs                # padding rows of the expert's last tile
    if GATHER_TOKENS:
        rows = pairs // top_k
    else:
        rows = pairs
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + expert * N * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + rows[:, None] * K + ks[None, :], mask=pair_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_base + cols[None, :] * K + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        if FP32_DOT:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SCALE_ROWS:
        acc *= tl.load(route_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=pair_ok[:, None] & col_ok[None, :])


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """The tile's rows: near the pairs an expert gets on average (decode steps give each expert
    a few rows: a 64-row tile would be mostly padding), between 16 (tl.dot's least) and 64."""
    average = num_pairs / max(num_experts, 1)
    return 16 if average <= 16 else 32 if average <= 32 else 64


def group_by_expert(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] (each token's experts) -> (pairs, tile_expert, counts), on ids' device and
    without reading anything on the host:

    - pairs [capacity]: pair indices (token * k + slot), each expert's in a run of whole
      block_m tiles, in token order within the run; padding holds T * k;
    - tile_expert [capacity / block_m]: the expert of each tile, -1 past the last run;
    - counts [E]: pairs per expert.

    The capacity bounds any routing's padded length: T * k pairs plus at most block_m - 1
    padding rows for each expert that got any (at most min(T * k, E) of them)."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = torch.cumsum(padded, 0)
    run_start = run_end - padded
    first_pair = torch.cumsum(counts, 0) - counts       # an expert's first place in sorted order
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat[order]
    rank = torch.arange(num_pairs, device=device) - first_pair[sorted_expert]
    capacity = -(-(num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m) * block_m
    pairs = torch.full((capacity,), num_pairs, dtype=torch.long, device=device)
    pairs[run_start[sorted_expert] + rank] = order
    tile_start = torch.arange(0, capacity, block_m, device=device)
    tile_expert = torch.searchsorted(run_end, tile_start, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert,
                              torch.full_like(tile_expert, -1))
    return pairs, tile_expert, counts


def _expert_gemm(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                 route: Optional[torch.Tensor], pairs: torch.Tensor, tile_expert: torch.Tensor,
                 num_pairs: int, top_k: int, block_m: int, gather_tokens: bool) -> torch.Tensor:
    """One projection of every pair: a [rows, K] (tokens where gather_tokens, else pairs), w
    [E, N, K] -> [num_pairs, N] in a's dtype."""
    a, w = a.contiguous(), w.contiguous()
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return out
    block_n = 64 if n >= 64 else 32 if n >= 32 else 16
    block_k = 64 if k >= 64 else 32 if k >= 32 else 16
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    fp32_dot = a.dtype == torch.float32 or INTERPRETING
    _expert_gemm_kernel[grid](a, w, bias if bias is not None else a,
                              route if route is not None else a, out, pairs, tile_expert,
                              num_pairs, n, k, top_k, BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_K=block_k, GATHER_TOKENS=gather_tokens,
                              HAS_BIAS=bias is not None, SCALE_ROWS=route is not None,
                              FP32_DOT=fp32_dot)
    return out


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor,
                  activation: Callable[[torch.Tensor], torch.Tensor],
                  gate_up_bias: Optional[torch.Tensor] = None,
                  down_bias: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], routing weights [T, k] and expert ids [T, k], the stacks gate_up [E, 2 I, H]
    and down [E, H, I] (and their biases [E, 2 I], [E, H]), activation [P, 2 I] -> [P, I] ->
    (sum over each token's experts of weight x expert(x) [T, H] in x's dtype, the pairs per
    expert [E]): StackedExperts.forward's result, with no host read."""
    tokens, top_k = ids.shape
    num_experts = gate_up.shape[0]
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x), torch.zeros(num_experts, dtype=torch.long, device=x.device)
    block_m = block_m_for(num_pairs, num_experts)
    pairs, tile_expert, counts = group_by_expert(ids, num_experts, block_m)
    inner = activation(_expert_gemm(x, gate_up, gate_up_bias, None, pairs, tile_expert,
                                    num_pairs, top_k, block_m, gather_tokens=True))
    route = weights.reshape(-1).to(torch.float32).contiguous()
    out = _expert_gemm(inner, down, down_bias, route, pairs, tile_expert, num_pairs, top_k,
                       block_m, gather_tokens=False)
    return out.view(tokens, top_k, -1).sum(dim=1), counts
