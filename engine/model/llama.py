"""The Llama family (Llama 2 / 3.x with llama3 RoPE scaling, SmolLM2, TinyLlama, Mistral) and
Qwen2 (qkv bias): pre-norm decoder layers, the shape most families share (Qwen3, Phi-3 reuse it).
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from .arch import ModelArch, sliding_windows
from .decoder import MLP, Attention, RMSNorm, add_norm
from .shard import ShardSizes, TensorParallelGroup

COMPLETE_WITH_TRANSFORMERS = False   # config.json read as it is (the generic defaults are Llama's)


def read_config(cfg: dict) -> dict:
    model_type = cfg["model_type"]
    bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias: true (MLP projections with biases) is not supported")
    # Llama's attention_bias covers o_proj too; Qwen2's biases are q/k/v only; Mistral has none
    out = {"qkv_bias": bias, "o_bias": bias and model_type == "llama"}
    if model_type == "mistral":
        # Mistral 7B v0.1's 4,096-key window on every layer, masked as transformers and vLLM
        # mask it (its positions run to 32k); later Mistrals have none
        out["layer_windows"] = sliding_windows(cfg)
    return out


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual stream travels beside the hidden states so that each norm
    can be fused with the residual add before it (as vLLM does)."""

    NORMS = ("input_layernorm", "post_attention_layernorm")   # their checkpoint names

    def __init__(self, arch: ModelArch, layer_index: int, shard: ShardSizes,
                 tp: Optional[TensorParallelGroup]):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_index, shard, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = self.make_mlp(arch, layer_index, shard, tp)

    @staticmethod
    def make_mlp(arch: ModelArch, layer_index: int, shard: ShardSizes,
                 tp: Optional[TensorParallelGroup]) -> nn.Module:
        """The layer's feed-forward (a mixture of experts overrides it)."""
        return MLP(arch, shard, tp)

    def forward(self, hidden, residual, positions, rotary, kv_cache, meta, backend, ops):
        hidden, residual = add_norm(ops, hidden, residual, self.input_layernorm)
        hidden = self.self_attn.forward(hidden, positions, rotary, kv_cache, meta, backend, ops)
        hidden, residual = add_norm(ops, hidden, residual, self.post_attention_layernorm)
        return self.mlp.forward(hidden, ops), residual
