"""Gemma 2 and Gemma 3 (text): GeGLU MLP, embeddings scaled by sqrt(hidden_size), RMSNorm weights
applied as 1 + w, a norm before and after both attention and MLP, sliding-window layers
alternating with global ones (Gemma 3: five local to one global, the local ones with their own
RoPE base), and Gemma 2's logit soft-capping of attention scores and of the final logits. Gemma 3
normalizes q and k head by head, as Qwen3 does.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from .arch import ModelArch, rope_kind, sliding_windows
from .decoder import MLP, Attention, RMSNorm, add_norm, norm
from .shard import ShardSizes, TensorParallelGroup

COMPLETE_WITH_TRANSFORMERS = True


def read_config(cfg: dict) -> dict:
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: true (an embedding model) is not supported")
    fields = {"qkv_bias": bool(cfg.get("attention_bias", False)),
              "o_bias": bool(cfg.get("attention_bias", False)),
              "norm_offset": 1.0, "embedding_scale": float(cfg["hidden_size"]) ** 0.5,
              "attention_scale": float(cfg["query_pre_attn_scalar"]) ** -0.5,
              "attn_softcap": float(cfg.get("attn_logit_softcapping") or 0.0),
              "final_softcap": float(cfg.get("final_logit_softcapping") or 0.0),
              "layer_windows": sliding_windows(cfg)}
    if cfg["model_type"] == "gemma3_text":
        fields["qk_norm"] = "head"
        rope = cfg["rope_parameters"]              # per layer type (transformers' standard form)
        full, local = rope["full_attention"], rope["sliding_attention"]
        fields.update(rope_theta=float(full["rope_theta"]), rope_scaling=_scaling(full),
                      local_rope=(float(local["rope_theta"]), _scaling(local)))
    return fields


def _scaling(rope: dict) -> Optional[dict]:
    return dict(rope) if rope_kind(rope) != "default" else None


class DecoderLayer(nn.Module):
    """x -> h = x + norm(attn(norm(x))) -> h + norm(mlp(norm(h))), the residual stream beside
    the hidden states as in the Llama layer (each pre-norm fused with its residual add)."""

    NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm")   # their checkpoint names

    def __init__(self, arch: ModelArch, layer_index: int, shard: ShardSizes,
                 tp: Optional[TensorParallelGroup]):
        super().__init__()
        eps = arch.rms_norm_eps
        self.input_layernorm = RMSNorm(arch.hidden_size, eps)
        self.self_attn = Attention(arch, layer_index, shard, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps)
        self.mlp = MLP(arch, shard, tp)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps)

    def forward(self, hidden, residual, positions, rotary, kv_cache, meta, backend, ops):
        hidden, residual = add_norm(ops, hidden, residual, self.input_layernorm)
        hidden = self.self_attn.forward(hidden, positions, rotary, kv_cache, meta, backend, ops)
        hidden = norm(ops, hidden, self.post_attention_layernorm)
        pre = self.pre_feedforward_layernorm
        hidden, residual = ops.add_rms_norm(hidden, residual, pre.weight, pre.eps)
        return norm(ops, self.mlp.forward(hidden, ops), self.post_feedforward_layernorm), residual
