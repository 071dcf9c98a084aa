"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral) and Qwen2, in plain torch.

The model runs on a flat batch: all scheduled tokens of all sequences in one [T] tensor with their
positions, and attention reads/writes the paged KV cache through `AttentionMetadata`. q/k/v and
gate/up projections are fused at load time (one GEMM each instead of three and two).

A `ModelPartition` says which layers (pipeline stage) this instance holds, and which tensor-parallel
shard of them (shard.py has the split); the embedding lives on the first stage, the final norm and
LM head on the last. With tp > 1 the instance computes on its local heads and MLP rows and
all-reduces after o_proj and down_proj; with tp = 1 no collective is called.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..attention import AttentionBackend, AttentionMetadata
from .arch import ModelArch
from .ops import TorchOps
from .shard import ShardSizes, TensorParallelGroup, shard_sizes


@dataclass(frozen=True)
class ModelPartition:
    """Layers [layer_start, layer_end) of the model, tensor-parallel shard tp_rank of tp_size;
    defaults to all of it."""

    layer_start: int = 0
    layer_end: Optional[int] = None
    tp_rank: int = 0
    tp_size: int = 1

    def resolve(self, num_layers: int) -> "ModelPartition":
        end = num_layers if self.layer_end is None else self.layer_end
        if not 0 <= self.layer_start < end <= num_layers:
            raise ValueError(f"layer range [{self.layer_start}, {end}) is outside 0..{num_layers}")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside 0..{self.tp_size - 1} "
                             f"(tp_size {self.tp_size})")
        return ModelPartition(self.layer_start, end, self.tp_rank, self.tp_size)

    def is_first(self) -> bool:
        return self.layer_start == 0

    def is_last(self, num_layers: int) -> bool:
        return self.layer_end == num_layers


class RMSNorm(nn.Module):
    """Holds the norm's weight and epsilon; the maths is in ops (fused with the residual add)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = arch.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class Rotary(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by position."""

    def __init__(self, arch: ModelArch, max_positions: int):
        super().__init__()
        self.arch, self.max_positions = arch, max_positions
        half = arch.head_dim // 2
        self.register_buffer("cos", torch.empty(max_positions, half), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, half), persistent=False)
        if self.cos.device.type != "meta":
            self.reset()

    def reset(self) -> None:
        """(Re)computes the tables on the buffers' device (after building on the meta device)."""
        inv_freq = rope_inv_freq(self.arch)
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        self.cos = freqs.cos().to(self.cos.device)
        self.sin = freqs.sin().to(self.sin.device)


class Attention(nn.Module):
    """This rank's heads: column-parallel qkv_proj, row-parallel o_proj (+ all-reduce if tp > 1)."""

    def __init__(self, arch: ModelArch, layer_index: int, shard: ShardSizes,
                 tp: Optional[TensorParallelGroup]):
        super().__init__()
        self.layer_index, self.tp = layer_index, tp
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, shard.q_size + 2 * shard.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(shard.q_size, arch.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend, ops) -> torch.Tensor:
        tokens = hidden.shape[0]
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = ops.rotary(self.qkv_proj.forward(hidden), positions, rotary.cos, rotary.sin,
                         num_heads + num_kv_heads, head_dim)
        q, k, v = qkv.view(tokens, num_heads + 2 * num_kv_heads, head_dim).split(
            (num_heads, num_kv_heads, num_kv_heads), dim=1)
        key_cache, value_cache = kv_cache
        backend.write_kv(key_cache, value_cache, k, v, meta)
        out = backend.attend(q, key_cache, value_cache, meta, self.scale)
        out = self.o_proj.forward(out.view(tokens, num_heads * head_dim))
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out


class MLP(nn.Module):
    """This rank's intermediate rows: column-parallel gate_up_proj, row-parallel down_proj."""

    def __init__(self, arch: ModelArch, shard: ShardSizes, tp: Optional[TensorParallelGroup]):
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * shard.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shard.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        out = self.down_proj.forward(ops.gate_up_silu_mul(self.gate_up_proj, x))
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual stream travels beside the hidden states so that each norm
    can be fused with the residual add before it (as vLLM does)."""

    def __init__(self, arch: ModelArch, layer_index: int, shard: ShardSizes,
                 tp: Optional[TensorParallelGroup]):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_index, shard, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch, shard, tp)

    def forward(self, hidden, residual, positions, rotary, kv_cache, meta, backend, ops):
        norm = self.input_layernorm
        if residual is None:
            residual = hidden
            hidden = ops.rms_norm(hidden, norm.weight, norm.eps)
        else:
            hidden, residual = ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        hidden = self.self_attn.forward(hidden, positions, rotary, kv_cache, meta, backend, ops)
        norm = self.post_attention_layernorm
        hidden, residual = ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return self.mlp.forward(hidden, ops), residual


class CausalLM(nn.Module):
    """One partition (pipeline stage x tensor-parallel shard) of a Llama/Qwen2 causal LM.

    `tp_group` is required when partition.tp_size > 1 and must be that rank of that size.
    """

    # the dtype its linears' weights are packed in (loader.finish_partition: bf16 for a bf16
    # model on CPU, whose activations stay fp32)
    linear_weight_dtype = torch.float32

    def __init__(self, arch: ModelArch, max_positions: int,
                 partition: ModelPartition = ModelPartition(),
                 tp_group: Optional[TensorParallelGroup] = None):
        super().__init__()
        self.arch = arch
        self.partition = partition.resolve(arch.num_layers)
        self.shard = shard_sizes(arch, self.partition.tp_rank, self.partition.tp_size)
        rank, size = self.shard.tp_rank, self.shard.tp_size
        if size > 1 and (getattr(tp_group, "rank", None), getattr(tp_group, "size", None)) != (rank, size):
            raise ValueError(f"tensor-parallel rank {rank} of {size} needs a TensorParallelGroup of "
                             f"that rank and size, got {tp_group}")
        # None on one rank: the single-process path calls no collective at all
        self.tp = tp_group if size > 1 else None
        self.is_first = self.partition.is_first()
        self.is_last = self.partition.is_last(arch.num_layers)
        # the weight is given, so no init runs: every caller fills it, and normal_ on the meta
        # device would import torch._dynamo (about 2 s of every process's startup)
        self.embed_tokens = (nn.Embedding(self.shard.vocab_shard, arch.hidden_size,
                                          _weight=torch.empty(self.shard.vocab_shard,
                                                              arch.hidden_size))
                             if self.is_first or (self.is_last and arch.tie_word_embeddings) else None)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, self.shard, self.tp) for i in
                                    range(self.partition.layer_start, self.partition.layer_end))
        self.rotary = Rotary(arch, max_positions)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if self.is_last else None
        self.lm_head = (nn.Linear(arch.hidden_size, self.shard.vocab_shard, bias=False)
                        if self.is_last else None)
        self.tie_weights()
        self.ops = TorchOps

    @property
    def num_local_heads(self) -> int:
        return self.shard.num_heads

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank caches: the KV tensors it allocates are [blocks, this, block, head_dim]."""
        return self.shard.num_kv_heads

    def use_ops(self, ops) -> None:
        """TorchOps (portable), NativeOps (fused CPU kernels) or TritonOps (fused CUDA kernels)."""
        self.ops = ops

    def tie_weights(self) -> None:
        if self.lm_head is not None and self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: Optional[torch.Tensor], positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend: AttentionBackend, hidden: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None):
        """Token ids (first stage) or the previous stage's (hidden, residual) -> (hidden, residual).

        A stage boundary passes both tensors, [T, hidden_size] each (whole, on every TP rank).
        """
        if self.is_first:
            hidden, residual = self._embed(input_ids), None
        # .forward, not __call__: ~10 us of hook bookkeeping a module call (no hooks are ever
        # registered here), x 8 modules x 30 layers a step
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer.forward(hidden, residual, positions, self.rotary, kv_cache, meta,
                                             backend, self.ops)
        return hidden, residual

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.embed_tokens(input_ids)
        # vocab-parallel: ids outside this rank's rows give zero rows; the sum over ranks is whole
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_rows)
        hidden = self.embed_tokens(local.masked_fill(outside, 0))
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(hidden)

    def _final_norm(self, hidden: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        if residual is None:
            return self.ops.rms_norm(hidden, self.norm.weight, self.norm.eps)
        return self.ops.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """Final norm and LM head for the given rows (copies: the fused norm works in place).

        -> [rows, vocab_size] on every TP rank (local logits gathered, padding dropped).
        """
        logits = self.lm_head(self._final_norm(hidden, residual)).float()
        if self.tp is None:
            return logits
        logits = self.tp.all_gather_last_dim(logits)
        if logits.shape[-1] != self.shard.vocab_size:
            logits = logits[:, : self.shard.vocab_size].contiguous()
        return logits

    def compute_logits_columns(self, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                               out: torch.Tensor) -> None:
        """This rank's real vocabulary rows of the logits, transposed into out [vocab_rows, rows]
        (the column-wise samplers' layout: a TP rank's shard is a row range of the full [V, rows], so
        no all-gather). The same LM head as compute_logits, so the same values, bit for bit;
        `out` may live in host memory."""
        logits = self.lm_head(self._final_norm(hidden, residual))
        out.copy_(logits[:, : self.shard.vocab_rows].t())
