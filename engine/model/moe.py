"""The mixture-of-experts feed-forward and the decoder layer around it (Qwen2-MoE, Qwen3-MoE,
Mixtral): a router picks each token's top-k experts; the experts run grouped (fused_experts.py);
Qwen2-MoE adds a shared expert that every token runs, scaled by a sigmoid gate. Layers the config
marks dense (`mlp_only_layers`, `decoder_sparse_step`) keep the dense MLP.

Under TP every rank routes every token (the router is replicated and tiny) and holds its block of
each expert's intermediate rows, so its experts' and shared expert's outputs are partial sums;
one all-reduce after both adds them up (the shared expert's gate is per token, so it scales the
partial sums before the reduce exactly as it would the whole).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import nn

from .arch import ModelArch, MoESpec
from .decoder import MLP
from .llama import DecoderLayer
from .fused_experts import StackedExperts, route
from .shard import ShardSizes, TensorParallelGroup


def read_moe(cfg: dict, num_experts: int, shared_rows: int = 0, block_name: str = "mlp",
             projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
             intermediate_key: str = "moe_intermediate_size") -> MoESpec:
    """The MoESpec of a completed config (transformers' names): which layers are sparse from
    `mlp_only_layers` and `decoder_sparse_step` where the config has them (else every layer)."""
    if (cfg.get("hidden_act") or "silu") != "silu":
        raise ValueError(f"hidden_act {cfg.get('hidden_act')!r}: the experts run SiLU only")
    layers = int(cfg["num_hidden_layers"])
    dense = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    sparse = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0
                   for i in range(layers))
    return MoESpec(num_experts=num_experts, top_k=int(cfg["num_experts_per_tok"]),
                   intermediate_size=int(cfg[intermediate_key]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), sparse_layers=sparse,
                   shared_intermediate_size=shared_rows, block_name=block_name,
                   projections=projections)


class SparseMoE(nn.Module):
    """Router (`gate`), the stacked experts and, where the model has one, the shared expert
    with its gate; parameter names follow the checkpoint's (loader.py maps the experts)."""

    def __init__(self, arch: ModelArch, shard: ShardSizes, tp: Optional[TensorParallelGroup]):
        super().__init__()
        moe = arch.moe
        self.tp, self.top_k, self.normalize = tp, moe.top_k, moe.norm_topk_prob
        self.gate = nn.Linear(arch.hidden_size, moe.num_experts, bias=False)
        self.gate.quantizable = False     # model.quantization: routers keep their precision
        self.experts = StackedExperts(moe.num_experts, arch.hidden_size,
                                      shard.expert_intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            self.shared_expert = MLP(arch, shard, None, rows=shard.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        weights, ids = route(self.gate.forward(x), self.top_k, self.normalize)
        out = self.experts.forward(x, weights, ids, ops)
        if self.shared_expert is not None:
            shared = self.shared_expert.forward(x, ops)
            out += torch.sigmoid(self.shared_expert_gate.forward(x)) * shared
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out


class MoEDecoderLayer(DecoderLayer):
    """The Llama family's pre-norm layer (q/k norms where the arch has them) whose feed-forward
    is a SparseMoE, or the dense MLP on the layers the config keeps dense."""

    @staticmethod
    def make_mlp(arch: ModelArch, layer_index: int, shard: ShardSizes,
                 tp: Optional[TensorParallelGroup]) -> nn.Module:
        return (SparseMoE(arch, shard, tp) if arch.is_sparse(layer_index)
                else MLP(arch, shard, tp))


def moe_tensor_shapes(arch: ModelArch, prefix: str,
                      quantized: bool = True) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A sparse layer's feed-forward tensors in the checkpoint (`prefix`: 'model.layers.N.'):
    the router, each expert's three projections, the shared expert and its gate (GPT-OSS: the
    stacked experts, in MXFP4 where the config says so and `quantized`)."""
    moe, h = arch.moe, arch.hidden_size
    block, rows = f"{prefix}{moe.block_name}.", moe.intermediate_size
    if moe.stacked_checkpoint:
        yield from _stacked_tensor_shapes(arch, block, quantized)
        return
    gate, up, down = moe.projections
    yield f"{block}gate.weight", (moe.num_experts, h)
    for e in range(moe.num_experts):
        yield f"{block}experts.{e}.{gate}.weight", (rows, h)
        yield f"{block}experts.{e}.{up}.weight", (rows, h)
        yield f"{block}experts.{e}.{down}.weight", (h, rows)
    if moe.shared_intermediate_size:
        shared = moe.shared_intermediate_size
        yield f"{block}shared_expert.gate_proj.weight", (shared, h)
        yield f"{block}shared_expert.up_proj.weight", (shared, h)
        yield f"{block}shared_expert.down_proj.weight", (h, shared)
        yield f"{block}shared_expert_gate.weight", (1, h)


def _stacked_tensor_shapes(arch: ModelArch, block: str, quantized: bool):
    """GPT-OSS's feed-forward: a biased router (`router`) and every expert stacked in one tensor
    per projection, as transformers' GptOssExperts holds them (gate/up [E, H, 2 I], interleaved;
    down [E, I, H]), or in MXFP4: [E, out, in / 32, 16] blocks and [E, out, in / 32] scales."""
    moe, h = arch.moe, arch.hidden_size
    e, rows = moe.num_experts, moe.intermediate_size
    yield f"{block}router.weight", (e, h)
    yield f"{block}router.bias", (e,)
    if moe.mxfp4 and quantized:
        yield f"{block}experts.gate_up_proj_blocks", (e, 2 * rows, h // 32, 16)
        yield f"{block}experts.gate_up_proj_scales", (e, 2 * rows, h // 32)
        yield f"{block}experts.down_proj_blocks", (e, h, rows // 32, 16)
        yield f"{block}experts.down_proj_scales", (e, h, rows // 32)
    else:
        yield f"{block}experts.gate_up_proj", (e, h, 2 * rows)
        yield f"{block}experts.down_proj", (e, rows, h)
    yield f"{block}experts.gate_up_proj_bias", (e, 2 * rows)
    yield f"{block}experts.down_proj_bias", (e, h)
