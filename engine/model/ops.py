"""The decoder's element-wise steps, in two interchangeable implementations.

`TorchOps` is plain torch (any device, any dtype) and the reference. `NativeOps` calls the fused
CPU kernels (kernels/fused_ops.cpp): one memory pass per step instead of several torch ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .fast_linear import BlockedLinear, PairedBf16Linear
from .int8_linear import Int8Linear


class TorchOps:
    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    @classmethod
    def add_rms_norm(cls, x, residual, weight, eps):
        """-> (norm(x + residual), x + residual)"""
        residual = x + residual
        return cls.rms_norm(residual, weight, eps), residual

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @classmethod
    def gate_up_silu_mul(cls, gate_up_proj, x: torch.Tensor) -> torch.Tensor:
        return cls.silu_and_mul(gate_up_proj(x))

    @staticmethod
    def rotary(qkv: torch.Tensor, positions, cos, sin, num_heads: int, head_dim: int) -> torch.Tensor:
        """Rotates the first `num_heads` heads of qkv [T, heads*head_dim]; returns the new qkv."""
        tokens = qkv.shape[0]
        heads = qkv.view(tokens, -1, head_dim)
        x = heads[:, :num_heads]
        c = cos[positions].unsqueeze(1).to(qkv.dtype)
        s = sin[positions].unsqueeze(1).to(qkv.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        return torch.cat((rotated, heads[:, num_heads:]), dim=1).view(tokens, -1)


class NativeOps:
    name = "native"
    # SiLU-and-mul as the gate/up GEMM's epilogue where it can (False: its own pass after the
    # GEMM; the same bits either way for the fp32/bf16 blocked kernel, the same to fp32 rounding
    # for int8; a switch for measuring the fusion)
    fuse_silu_mul = True

    @staticmethod
    def rms_norm(x, weight, eps):
        return torch.ops.batchinfer.rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(x, residual, weight, eps):
        torch.ops.batchinfer.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    @staticmethod
    def silu_and_mul(gate_up):
        return torch.ops.batchinfer.silu_and_mul(gate_up)

    @classmethod
    def gate_up_silu_mul(cls, gate_up_proj, x):
        """One pass where the gate/up projection is a BlockedLinear, PairedBf16Linear (or its AMX
        subclass) or Int8Linear that can fuse (the first two: the same bits as the two ops; an
        Int8Linear: the same maths, to fp32 rounding); else the GEMM, then silu_and_mul."""
        if (isinstance(gate_up_proj, (BlockedLinear, PairedBf16Linear, Int8Linear))
                and gate_up_proj.can_fuse_silu_mul
                and cls.fuse_silu_mul):
            return gate_up_proj.silu_mul(x)
        return cls.silu_and_mul(gate_up_proj(x))

    @staticmethod
    def rotary(qkv, positions, cos, sin, num_heads, head_dim):
        torch.ops.batchinfer.rotary_embedding(qkv, positions, cos, sin, num_heads, head_dim)
        return qkv
