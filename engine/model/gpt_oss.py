"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): the Llama family's pre-norm layer with

- attention sinks: a learned logit per head that joins each query's softmax denominator (and
  takes no value), passed to the attention backend per layer (`self_attn.sinks`);
- sliding-window layers (128 keys) alternating with full ones (`layer_types`), biases on q/k/v
  and o_proj, YaRN RoPE (rope.py);
- a mixture of experts on every layer: a biased linear router whose top-k logits are softmaxed
  among themselves, experts with biases after both projections and a clamped SwiGLU
  (gate clamped above at `swiglu_limit`, up to +-limit, (up + 1) * gate * sigmoid(1.702 gate)),
  run grouped as the other families' experts are (fused_experts.BiasedExperts).

The checkpoint stacks each layer's experts as transformers' GptOssExperts holds them:
`mlp.experts.gate_up_proj` [E, H, 2 I] with gate and up interleaved (even columns gate, odd up),
`down_proj` [E, I, H] and their biases; the released checkpoints keep the projections in MXFP4
instead (`*_blocks` [E, out, in / 32, 16] of packed 4-bit values, `*_scales` [E, out, in / 32]
of power-of-two exponents), de-quantized here at load to the engine's dtype (loader.py turns
either form into our [E, 2 I, H] gate-then-up and [E, H, I] stacks, a TP rank's rows of each).
A TP rank reads only its share of the MXFP4 blocks and scales (`mxfp4_span`) and de-quantizes
that, a bounded chunk of experts at a time (`dequantize_experts`): gpt-oss-120b's gate/up alone
is 8.5 GB a layer in fp32, whole.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .arch import ModelArch, MoESpec, sliding_windows
from .fused_experts import BiasedExperts, route_topk_softmax
from .llama import DecoderLayer as LlamaDecoderLayer
from .shard import ShardSizes, TensorParallelGroup

COMPLETE_WITH_TRANSFORMERS = True   # layer_types, YaRN parameters and biases by default

# the values of MXFP4's 4-bit codes (e2m1: sign, two exponent bits, one mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32                     # values that share a scale (a block's 16 bytes)
# the most fp32 one de-quantization makes at once (at least one expert's; read at each call)
DEQUANT_CHUNK_BYTES = 64 << 20


def read_config(cfg: dict) -> dict:
    quant = cfg.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method not in (None, "mxfp4"):
        raise ValueError(f"quantization_config.quant_method {method!r}: GPT-OSS checkpoints load "
                         "unquantized or in MXFP4 (de-quantized at load)")
    layers = int(cfg["num_hidden_layers"])
    moe = MoESpec(num_experts=int(cfg["num_local_experts"]),
                  top_k=int(cfg["num_experts_per_tok"]),
                  intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=False,
                  sparse_layers=(True,) * layers, routing="topk_softmax", expert_bias=True,
                  swiglu=(float(cfg.get("swiglu_alpha", 1.702)),
                          float(cfg.get("swiglu_limit", 7.0))),
                  stacked_checkpoint=True, mxfp4=method == "mxfp4")
    bias = bool(cfg.get("attention_bias", True))
    return {"qkv_bias": bias, "o_bias": bias, "layer_windows": sliding_windows(cfg),
            "attention_sinks": True, "moe": moe}


class GptOssMoE(nn.Module):
    """The router (`router`, a biased linear, replicated on every TP rank) and the experts (this
    rank's rows of each); one all-reduce after them under TP."""

    def __init__(self, arch: ModelArch, shard: ShardSizes, tp: Optional[TensorParallelGroup]):
        super().__init__()
        moe = arch.moe
        self.tp, self.top_k = tp, moe.top_k
        self.router = nn.Linear(arch.hidden_size, moe.num_experts, bias=True)
        self.router.quantizable = False   # model.quantization: routers keep their precision
        self.experts = BiasedExperts(moe.num_experts, arch.hidden_size,
                                     shard.expert_intermediate_size, moe.swiglu)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        weights, ids = route_topk_softmax(self.router.forward(x), self.top_k)
        out = self.experts.forward(x, weights, ids, ops)
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out


class DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer (the attention takes the sinks and the layer's window from the
    arch) whose feed-forward is GptOssMoE."""

    @staticmethod
    def make_mlp(arch: ModelArch, layer_index: int, shard: ShardSizes,
                 tp: Optional[TensorParallelGroup]) -> nn.Module:
        return GptOssMoE(arch, shard, tp)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 -> dense: blocks [..., G, 16] (two 4-bit codes a byte, the low nibble first) and
    scales [..., G] (exponents biased by 127) -> [..., G * 32], each group of 32 values times
    2 ** (scale - 127). As transformers' convert_moe_packed_tensors, without its transpose."""
    blocks = blocks.to(torch.uint8)
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks of shape {tuple(blocks.shape)} do not match scales of "
                         f"shape {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    out = torch.empty(*blocks.shape[:-1], blocks.shape[-1] * 2, dtype=dtype)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    exponents = scales.to(torch.int32) - 127
    out = torch.ldexp(out, exponents.unsqueeze(-1).to(dtype))
    return out.reshape(*blocks.shape[:-2], -1)


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[E, 2 n, ...] with gate and up alternating along dim 1 -> gate rows, then up rows."""
    return t.unflatten(1, (-1, 2)).transpose(1, 2).flatten(1, 2).contiguous()


def mxfp4_span(gate_up: bool, lo: int, rows: int) -> tuple[int, int, int, int]:
    """Where a TP rank's intermediate rows [lo, lo + rows) of an expert projection lie in its
    MXFP4 blocks and scales -> (dim, first, end, skip): gate/up's rows [2 lo, 2 (lo + rows))
    along dim 1 (gate and up interleaved, so the rank's are contiguous; skip 0); down's input
    columns are packed along dim 2 in groups of 32, so the groups that cover them, and how many
    de-quantized columns precede the rank's first (a rank's share need not start a group)."""
    if gate_up:
        return 1, 2 * lo, 2 * (lo + rows), 0
    first, end = lo // MXFP4_GROUP, -(-(lo + rows) // MXFP4_GROUP)
    return 2, first, end, lo - first * MXFP4_GROUP


def dequantize_experts(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                       layout: Callable[[torch.Tensor], torch.Tensor],
                       chunk_bytes: Optional[int] = None) -> None:
    """MXFP4 experts (blocks [E, out, G, 16], scales [E, out, G]: a rank's share) -> `out`
    [E, ...], `layout` turning each de-quantized [experts, out, G * 32] into out's, a chunk of
    experts at a time so that the fp32 made at once stays near `chunk_bytes` (default
    DEQUANT_CHUNK_BYTES; one expert at the least). Equal to de-quantizing whole, to the bit:
    each value depends on its own code and scale only."""
    if blocks.shape[0] != out.shape[0]:
        raise ValueError(f"MXFP4 blocks hold {blocks.shape[0]} experts, the config implies "
                         f"{out.shape[0]}")
    per_expert = 2 * blocks[0].numel() * 4           # fp32 values, two codes a byte
    step = max(1, (chunk_bytes or DEQUANT_CHUNK_BYTES) // max(per_expert, 1))
    for first in range(0, out.shape[0], step):
        part = layout(dequantize_mxfp4(blocks[first:first + step], scales[first:first + step]))
        dest = out[first:first + step]
        if tuple(part.shape) != tuple(dest.shape):
            raise ValueError(f"MXFP4 experts de-quantize to shape {tuple(part.shape)} a chunk, "
                             f"the config implies {tuple(dest.shape)}")
        dest.copy_(part)
