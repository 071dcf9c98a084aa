"""One partition of a causal LM of any registered family: embedding, that family's decoder layers,
final norm and LM head.

A `ModelPartition` says which layers (pipeline stage) this instance holds, and which tensor-parallel
shard of them (shard.py has the split); the embedding lives on the first stage, the final norm and
LM head on the last. A stage boundary passes (hidden, residual): every family's layers keep the
residual stream beside the hidden states (their sum is the stream), so any family splits anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..attention import AttentionBackend, AttentionMetadata
from .arch import ModelArch
from .decoder import RMSNorm
from .ops import TorchOps
from .registry import family_module
from .rope import Rotary
from .shard import TensorParallelGroup, shard_sizes


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


class CausalLM(nn.Module):
    """One partition (pipeline stage x tensor-parallel shard) of a causal LM whose layers are
    its family's DecoderLayer (registry.py).

    `tp_group` is required when partition.tp_size > 1 and must be that rank of that size.
    """

    # the dtype its linears' weights are packed in (loader.finish_partition: bf16 for a bf16
    # model on CPU, whose activations stay fp32)
    linear_weight_dtype = torch.float32
    linear_quantization = None      # int8_linear.LinearQuantization (model.quantization)
    lora = None                     # lora.LoraState where LoRA adapters are attached

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
        layer = family_module(arch.model_type).DecoderLayer
        self.layers = nn.ModuleList(layer(arch, i, self.shard, self.tp) for i in
                                    range(self.partition.layer_start, self.partition.layer_end))
        self.rotary = Rotary(arch, max_positions)
        # the sliding-window layers' own RoPE, where the family gives them one (Gemma 3)
        self.local_rotary = (Rotary(arch, max_positions, arch.local_rope)
                             if arch.local_rope is not None else None)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if self.is_last else None
        self.lm_head = (nn.Linear(arch.hidden_size, self.shard.vocab_shard, bias=False)
                        if self.is_last else None)
        self.tie_weights()
        self.ops = TorchOps
        # KV layer groups (kv_groups.py): each of this partition's layers' group, where the
        # cache has them; a step's metadata then carries a block table per group
        self.kv_layer_groups: Optional[tuple[int, ...]] = None

    @property
    def num_local_heads(self) -> int:
        return self.shard.num_heads

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank caches: the KV tensors it allocates are [blocks, this, block, head_dim]."""
        return self.shard.num_kv_heads

    def use_kv_groups(self, layout) -> None:
        """The cache is laid out in KV layer groups (a kv_groups.KVGroupLayout; None: one
        table): each layer attends over its group's block tables."""
        self.kv_layer_groups = None if layout is None else tuple(
            layout.layer_group[layer]
            for layer in range(self.partition.layer_start, self.partition.layer_end))

    def use_ops(self, ops) -> None:
        """TorchOps (portable), NativeOps (fused CPU kernels) or TritonOps (fused CUDA kernels)."""
        self.ops = ops

    def take_expert_load(self) -> Optional[dict[int, list[int]]]:
        """Tokens routed to each expert in each of this partition's sparse layers since the last
        call ({decoder layer index: [tokens per expert]}, read in one host copy); None for a
        dense model. Keyed by the layer's index in the whole model, so the stages of a pipeline
        merge without relying on the order their counts arrive in. Under TP every rank routes
        every token: any rank's count is the layer's."""
        taken = self.take_expert_load_on_device()
        if taken is None:
            return None
        layers, counts = taken
        return dict(zip(layers, counts.tolist()))

    def take_expert_load_on_device(self) -> Optional[tuple[tuple[int, ...], torch.Tensor]]:
        """take_expert_load's counts without reading them: (the sparse layers' indices, their
        tokens per expert [layers, experts] on the model's device), for a caller that copies
        them to the host without waiting (async scheduling); None for a dense model."""
        layers = [layer for layer in self.layers if hasattr(layer.mlp, "experts")]
        if not layers:
            return None
        device = self.rotary.cos.device
        loads = []
        for layer in layers:
            stack = layer.mlp.experts
            loads.append(torch.zeros(stack.num_experts, dtype=torch.long, device=device)
                         if stack.load is None else stack.load)
            stack.load = None
        return (tuple(layer.self_attn.layer_index for layer in layers), torch.stack(loads))

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
        if self.lora is not None:       # the step's adapter groups, read by every LoRA linear
            self.lora.step = meta.lora
        if self.is_first:
            hidden, residual = self._embed(input_ids), None
        # .forward, not __call__: ~10 us of hook bookkeeping a module call (no hooks are ever
        # registered here), x 8 modules x 30 layers a step
        groups = getattr(meta, "groups", ())
        if groups and self.kv_layer_groups is None:
            raise ValueError("the step has a block table per KV layer group, the model none")
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            rotary = self.rotary
            if self.local_rotary is not None and layer.self_attn.window:
                rotary = self.local_rotary
            group = self.kv_layer_groups[index] if groups else 0
            hidden, residual = layer.forward(hidden, residual, positions, rotary, kv_cache,
                                             groups[group - 1] if group else meta, backend,
                                             self.ops)
        return hidden, residual

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            hidden = self.embed_tokens(input_ids)
        else:
            # vocab-parallel: ids outside this rank's rows give zero rows; the sum over ranks is
            # whole
            local = input_ids - self.shard.vocab_start
            outside = (local < 0) | (local >= self.shard.vocab_rows)
            hidden = self.embed_tokens(local.masked_fill(outside, 0))
            hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
            hidden = self.tp.all_reduce(hidden)
        if self.arch.embedding_scale is not None:   # in the embeddings' dtype, as transformers
            hidden *= torch.tensor(self.arch.embedding_scale, dtype=hidden.dtype)
        return hidden

    def _head(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head, and the final logit soft-cap where the family has one (Gemma 2)."""
        logits = self.lm_head(normed)
        cap = self.arch.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def _final_norm(self, hidden: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        if residual is None:
            return self.ops.rms_norm(hidden, self.norm.weight, self.norm.eps)
        return self.ops.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """Final norm and LM head for the given rows (copies: the fused norm works in place).

        -> [rows, vocab_size] on every TP rank (local logits gathered, padding dropped).
        """
        logits = self._head(self._final_norm(hidden, residual)).float()
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
        logits = self._head(self._final_norm(hidden, residual))
        out.copy_(logits[:, : self.shard.vocab_rows].t())
