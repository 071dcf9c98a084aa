"""The blocks every family's decoder layer is made of: RMSNorm, attention, gated MLP.

The model runs on a flat batch: all scheduled tokens of all sequences in one [T] tensor with their
positions, and attention reads/writes the paged KV cache through `AttentionMetadata`. q/k/v and
gate/up projections are fused at load time (one GEMM each instead of three and two). With tp > 1
each block computes on its rank's heads and MLP rows (shard.py) and all-reduces after o_proj and
down_proj; with tp = 1 no collective is called.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend, AttentionMetadata
from .arch import ModelArch
from .rope import Rotary, partial_rotary
from .shard import ShardSizes, TensorParallelGroup


class RMSNorm(nn.Module):
    """Holds the norm's weight and epsilon; the maths is in ops (fused with the residual add)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


def norm(ops, x: torch.Tensor, module: RMSNorm) -> torch.Tensor:
    return ops.rms_norm(x, module.weight, module.eps)


def add_norm(ops, hidden: torch.Tensor, residual, module: RMSNorm):
    """A pre-norm block's input: the residual stream (the layer's input for the first layer, whose
    residual is None) plus `hidden`, normed -> (normed, residual)."""
    if residual is None:
        return ops.rms_norm(hidden, module.weight, module.eps), hidden
    return ops.add_rms_norm(hidden, residual, module.weight, module.eps)


class Attention(nn.Module):
    """This rank's heads: column-parallel qkv_proj, row-parallel o_proj (+ all-reduce if tp > 1).

    Optional, from the arch: q/k RMSNorm before RoPE (per head, or over all heads: then a TP rank
    gathers the other ranks' q and k to normalize them whole), RoPE on part of each head, an
    o_proj bias (held by TP rank 0 only, so the all-reduce adds it once), the layer's sliding
    window, a logit soft-cap and attention sinks (the attention backend applies all three).
    """

    lora_qkv = lora_o = None    # lora.LoraTarget where a LoRA adapter targets them

    def __init__(self, arch: ModelArch, layer_index: int, shard: ShardSizes,
                 tp: Optional[TensorParallelGroup]):
        super().__init__()
        self.layer_index, self.tp, self.shard = layer_index, tp, shard
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, shard.q_size + 2 * shard.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(shard.q_size, arch.hidden_size, bias=arch.o_bias)
        self.scale = arch.attention_scale or self.head_dim ** -0.5
        self.window, self.softcap = arch.window(layer_index), arch.attn_softcap
        self.qk_norm = arch.qk_norm
        if arch.qk_norm is not None:
            whole = arch.qk_norm == "full"
            self.q_norm = RMSNorm(arch.q_size if whole else arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.kv_size if whole else arch.head_dim, arch.rms_norm_eps)
        self.partial_rotary = arch.rotary_dim is not None
        # GPT-OSS: a logit per head (this rank's heads) in each softmax's denominator; None
        # elsewhere, so the backends take their plain paths
        self.sinks = nn.Parameter(torch.empty(shard.num_heads)) if arch.attention_sinks else None

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend, ops) -> torch.Tensor:
        tokens = hidden.shape[0]
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(hidden)
        if self.lora_qkv is not None:
            self.lora_qkv.add(qkv, hidden)
        if self.qk_norm == "head":
            self._norm_heads(qkv, ops)
        elif self.qk_norm == "full":
            self._norm_whole(qkv, ops)
        rotate = partial_rotary if self.partial_rotary else ops.rotary
        qkv = rotate(qkv, positions, rotary.cos, rotary.sin, num_heads + num_kv_heads, head_dim)
        q, k, v = qkv.view(tokens, num_heads + 2 * num_kv_heads, head_dim).split(
            (num_heads, num_kv_heads, num_kv_heads), dim=1)
        key_cache, value_cache = kv_cache
        backend.write_kv(key_cache, value_cache, k, v, meta)
        if self.sinks is not None:
            out = backend.attend(q, key_cache, value_cache, meta, self.scale, self.window,
                                 self.softcap, sinks=self.sinks)
        elif self.window or self.softcap:
            out = backend.attend(q, key_cache, value_cache, meta, self.scale, self.window,
                                 self.softcap)
        else:
            out = backend.attend(q, key_cache, value_cache, meta, self.scale)
        attended = out.view(tokens, num_heads * head_dim)
        out = self.o_proj.forward(attended)
        if self.lora_o is not None:        # this rank's share of the delta, before the sum
            self.lora_o.add(out, attended)
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out

    def _norm_heads(self, qkv: torch.Tensor, ops) -> None:
        """q and k normalized head by head, in place in qkv (Qwen3)."""
        q_size, kv_size, d = self.shard.q_size, self.shard.kv_size, self.head_dim
        for start, size, module in ((0, q_size, self.q_norm), (q_size, kv_size, self.k_norm)):
            part = qkv[:, start:start + size]
            part.copy_(norm(ops, part.reshape(-1, d), module).view(part.shape))

    def _norm_whole(self, qkv: torch.Tensor, ops) -> None:
        """q and k each normalized over all heads (OLMo 2), in place in qkv. A TP rank holds
        some heads: it gathers q|k from every rank (one all-gather) and keeps its own share."""
        sh = self.shard
        q_size, kv_size = sh.q_size, sh.kv_size
        local = qkv[:, :q_size + kv_size]
        if self.tp is None:
            q, k = local[:, :q_size], local[:, q_size:]
        else:
            every = self.tp.all_gather_last_dim(local).view(qkv.shape[0], sh.tp_size, -1)
            q = every[:, :, :q_size].reshape(qkv.shape[0], -1)
            k = every[:, :, q_size:].reshape(qkv.shape[0], -1)
        q_n, k_n = norm(ops, q, self.q_norm), norm(ops, k, self.k_norm)
        if self.tp is not None:
            q_n = q_n[:, sh.q_start:sh.q_start + q_size]
            k_n = k_n[:, sh.kv_start:sh.kv_start + kv_size]
        qkv[:, :q_size].copy_(q_n)
        qkv[:, q_size:q_size + kv_size].copy_(k_n)


class MLP(nn.Module):
    """This rank's intermediate rows: column-parallel gate_up_proj, row-parallel down_proj;
    act(gate) * up between them (SiLU: fused into the GEMM where the ops can). `rows`: this
    rank's intermediate rows where they are not the dense MLP's (a shared expert; its caller
    sums over the ranks, so it passes no tp)."""

    lora_gate_up = lora_down = None    # lora.LoraTarget where a LoRA adapter targets them

    def __init__(self, arch: ModelArch, shard: ShardSizes, tp: Optional[TensorParallelGroup],
                 rows: Optional[int] = None):
        super().__init__()
        self.tp, self.activation = tp, arch.hidden_act     # silu or gelu_pytorch_tanh (arch.py)
        rows = shard.intermediate_size if rows is None else rows
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * rows, bias=False)
        self.down_proj = nn.Linear(rows, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        lora = self.lora_gate_up
        if self.activation == "silu" and (lora is None or not lora.active):
            inner = ops.gate_up_silu_mul(self.gate_up_proj, x)
        else:
            gate_up = self.gate_up_proj.forward(x)
            if lora is not None:              # the delta goes in before the activation
                lora.add(gate_up, x)
            if self.activation == "silu":
                inner = ops.silu_and_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                inner = F.gelu(gate, approximate="tanh") * up
        out = self.down_proj.forward(inner)
        if self.lora_down is not None:
            self.lora_down.add(out, inner)
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out
