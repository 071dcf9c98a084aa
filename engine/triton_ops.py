"""The decoder's element-wise steps as Triton kernels, for CUDA (model/ops.py's third set).

A decode step of an 8B model at 256 sequences spent most of its GPU time outside the GEMMs and
attention: torch runs RMSNorm, the residual add, rotary and SiLU-and-mul as ~50 small kernels a
layer (benchmarks/engine/cuda_step_profile.py). Here each is one kernel, one pass over its rows,
in place like the CPU's NativeOps. Arithmetic in fp32, rounded to the model's dtype where torch
rounds (the residual sum, the normalized row, SiLU's output), so results stay within a rounding
of TorchOps'. CI runs them in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps,
                     BLOCK: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        x = x + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rounded = x.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * n_cols + cols, rounded, mask=mask)
        x = rounded.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, row_stride, num_heads,
                   HALF: tl.constexpr, HEADS_P2: tl.constexpr, HALF_P2: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    j = tl.arange(0, HALF_P2)
    h = tl.arange(0, HEADS_P2)
    j_ok = j < HALF
    mask = (h < num_heads)[:, None] & j_ok[None, :]
    c = tl.load(cos_ptr + pos * HALF + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * HALF + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    first = qkv_ptr + token * row_stride + h[:, None] * (2 * HALF) + j[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * c - x2 * s).to(qkv_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * c + x1 * s).to(qkv_ptr.dtype.element_ty), mask=mask)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TritonOps:
    """model/ops.py's interface: rms_norm returns a new tensor; add_rms_norm, rotary work in
    place (x becomes the normalized row, residual the sum), as NativeOps does."""

    name = "triton"

    @staticmethod
    def rms_norm(x, weight, eps):
        x = x.contiguous()
        out = torch.empty_like(x)
        rows, cols = x.numel() // x.shape[-1], x.shape[-1]
        if rows:
            _rms_norm_kernel[(rows,)](x, x, weight, out, cols, eps, BLOCK=_pow2(cols), ADD=False)
        return out

    @staticmethod
    def add_rms_norm(x, residual, weight, eps):
        """-> (norm(x + residual), x + residual), written into x and residual."""
        if not (x.is_contiguous() and residual.is_contiguous()):
            residual = x + residual
            return TritonOps.rms_norm(residual, weight, eps), residual
        rows, cols = x.numel() // x.shape[-1], x.shape[-1]
        if rows:
            _rms_norm_kernel[(rows,)](x, residual, weight, x, cols, eps, BLOCK=_pow2(cols), ADD=True)
        return x, residual

    @staticmethod
    def silu_and_mul(gate_up):
        gate_up = gate_up.contiguous()
        cols = gate_up.shape[-1] // 2
        rows = gate_up.numel() // gate_up.shape[-1]
        out = torch.empty(*gate_up.shape[:-1], cols, dtype=gate_up.dtype, device=gate_up.device)
        block = min(1024, _pow2(cols))
        if rows:
            _silu_mul_kernel[(rows, triton.cdiv(cols, block))](gate_up, out, cols, BLOCK=block)
        return out

    @classmethod
    def gate_up_silu_mul(cls, gate_up_proj, x):
        return cls.silu_and_mul(gate_up_proj(x))

    @staticmethod
    def rotary(qkv, positions, cos, sin, num_heads, head_dim):
        """Rotates the first `num_heads` heads of qkv [T, heads * head_dim] in place."""
        if qkv.stride(-1) != 1 or head_dim % 2:
            from .model.ops import TorchOps

            return TorchOps.rotary(qkv, positions, cos, sin, num_heads, head_dim)
        tokens = qkv.shape[0]
        if tokens:
            half = head_dim // 2
            _rotary_kernel[(tokens,)](qkv, positions, cos.contiguous(), sin.contiguous(),
                                      qkv.stride(0), num_heads, HALF=half,
                                      HEADS_P2=_pow2(num_heads), HALF_P2=_pow2(half))
        return qkv
