"""OLMo 2: norms after attention and after the MLP (none before them), and q and k each
RMS-normalized over all heads before RoPE."""
from __future__ import annotations

from typing import Optional

from torch import nn

from .arch import ModelArch
from .decoder import MLP, Attention, RMSNorm, norm
from .shard import ShardSizes, TensorParallelGroup

COMPLETE_WITH_TRANSFORMERS = True


def read_config(cfg: dict) -> dict:
    bias = bool(cfg.get("attention_bias", False))
    return {"qk_norm": "full", "qkv_bias": bias, "o_bias": bias}


class DecoderLayer(nn.Module):
    """x -> x + norm(attn(x)) -> h + norm(mlp(h)). Returns (norm(mlp(h)), h): their sum is the
    stream, the (hidden, residual) pair every family's layers pass on."""

    NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")   # checkpoint names

    def __init__(self, arch: ModelArch, layer_index: int, shard: ShardSizes,
                 tp: Optional[TensorParallelGroup]):
        super().__init__()
        self.self_attn = Attention(arch, layer_index, shard, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch, shard, tp)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, hidden, residual, positions, rotary, kv_cache, meta, backend, ops):
        stream = hidden if residual is None else residual + hidden
        attended = self.self_attn.forward(stream, positions, rotary, kv_cache, meta, backend, ops)
        stream = stream + norm(ops, attended, self.post_attention_layernorm)
        return norm(ops, self.mlp.forward(stream, ops), self.post_feedforward_layernorm), stream
