"""LoRA adapters applied in the batched forward (multi-LoRA, as vLLM's punica path).

The base linears run unchanged, whatever their kernel (fp32 / bf16 panels, oneDNN, int8), over
every token of the step. Then each fused linear an adapter targets adds its delta

    y[g] += scaling * (x[g] @ A^T) @ B^T

for each adapter's token group g of the step: the tokens of the sequences that use it. That is
one pair of small GEMMs per adapter touched and per linear, and no Python per token: the groups
are built once per step (`lora_step`) from the plan's adapter slot per sequence, and every
layer reads them from the partition's shared `LoraState`. A step where no sequence uses an
adapter has no groups, and each linear's check is one attribute read.

Layout. q/k/v adapters go into the fused qkv_proj and gate/up into gate_up_proj: their A
matrices stacked along the rank ([r_q + r_k + r_v, in]) and their B matrices block-diagonal
([out, r_q + r_k + r_v], each module's rows in its columns), so the fused linear gets one pair of
GEMMs. Tensor parallelism: column-parallel linears (qkv, gate_up) keep this rank's output rows of
B; row-parallel ones (o_proj, down_proj) this rank's input columns of A, and their partial delta
is added before the layer's all-reduce (the delta is linear in x, so the sum is exact). Pipeline
stages hold only their layers' adapters. A and B are kept in the model's activation dtype (fp32
on CPU, bf16 models included; the model's dtype on CUDA).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .lora_adapters import ROW_MODULES, Adapter, LoraSpec, read_adapter

# our fused linear -> the HF modules that feed it (column-parallel) or it is (row-parallel)
_FEEDS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.qkv_proj"),
          "o": ("self_attn.o_proj",),
          "gate_up": ("mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj"),
          "down": ("mlp.down_proj",)}


@dataclass
class LoraStep:
    """A step's token groups: (adapter slot, the rows of its tokens; None: every row)."""

    groups: list[tuple[int, Optional[torch.Tensor]]]


def lora_step(slots: Sequence[int], query_lens: Sequence[int],
              device: torch.device) -> Optional[LoraStep]:
    """The groups of a step whose sequence i uses adapter slot slots[i] (0: none) for its
    query_lens[i] tokens; None where no sequence uses one (or `slots` is empty)."""
    touched = sorted(set(slots) - {0}) if slots else []
    if not touched:
        return None
    if len(touched) == 1 and 0 not in slots:
        return LoraStep([(touched[0], None)])
    per_token = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int32),
                                        torch.tensor(query_lens, dtype=torch.int64))
    return LoraStep([(slot, torch.nonzero(per_token == slot).squeeze(1).to(device))
                     for slot in touched])


class LoraState:
    """The running step's groups, shared by every LoraTarget of a partition (CausalLM.forward
    sets it from the step's metadata)."""

    __slots__ = ("step",)

    def __init__(self):
        self.step: Optional[LoraStep] = None


class LoraTarget:
    """The adapters of one fused linear: slot -> (A [R, in], B [out, R], scaling)."""

    def __init__(self, state: LoraState):
        self.state = state
        self.pairs: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}

    @property
    def active(self) -> bool:
        return self.state.step is not None

    def add(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (the base linear's output for x) plus each adapter's delta on its tokens, in place."""
        step = self.state.step
        if step is None:
            return y
        for slot, rows in step.groups:
            pair = self.pairs.get(slot)
            if pair is None:
                continue
            a, b, scaling = pair
            if rows is None:
                y.addmm_(torch.mm(x, a.t()), b.t(), alpha=scaling)
            else:
                delta = torch.mm(torch.mm(x.index_select(0, rows), a.t()), b.t())
                y.index_add_(0, rows, delta, alpha=scaling)
        return y


def _column_pair(pieces_of, adapter: Adapter, layer: int, modules: tuple[str, ...],
                 out_rows: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """A fused column-parallel linear's (A stacked along the rank, B block-diagonal over this
    rank's output rows); None where the adapter targets none of `modules` in `layer`."""
    parts = [(m, adapter.weights[(layer, m)]) for m in modules if (layer, m) in adapter.weights]
    if not parts:
        return None
    a = torch.cat([pair[0] for _, pair in parts])
    b = torch.zeros(out_rows, a.shape[0], dtype=a.dtype)
    col = 0
    for module, (a_m, b_m) in parts:
        rank = a_m.shape[0]
        for start, rows, lo, _ in pieces_of(module)[1]:
            b[start:start + rows, col:col + rank] = b_m[lo:lo + rows]
        col += rank
    return a, b


def _row_pair(adapter: Adapter, layer: int, module: str, lo: int, cols: int
              ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """A row-parallel linear's (A's input columns of this rank, B whole)."""
    pair = adapter.weights.get((layer, module))
    if pair is None:
        return None
    return pair[0][:, lo:lo + cols].contiguous(), pair[1]


def attach_adapters(model, spec: LoraSpec) -> None:
    """Reads `spec`'s adapters for this partition's layers (a TP rank: its slices) and hangs a
    LoraTarget on each linear an adapter targets; model.lora is the shared state the forward
    sets. Checks each adapter first (read_adapter: ConfigError naming the path)."""
    from .decoder import MLP, Attention
    from .loader import _Filler

    sh, part = model.shard, model.partition
    layers = range(part.layer_start, part.layer_end)
    first = next(model.parameters())       # norms and embeddings: the activation dtype
    dtype, device = first.dtype, first.device
    pieces_of = _Filler(model)._column_pieces
    state = model.lora = LoraState()
    row_slices = {"self_attn.o_proj": (sh.q_start, sh.q_size),
                  "mlp.down_proj": (sh.intermediate_start, sh.intermediate_size)}
    for slot, (name, path) in enumerate(spec.modules, start=1):
        adapter = read_adapter(name, path, model.arch, spec.max_rank, layers)
        for index, layer in zip(layers, model.layers):
            attn, mlp = layer.self_attn, getattr(layer, "mlp", None)
            for target, feeds in _FEEDS.items():
                owner = attn if target in ("qkv", "o") else mlp
                if feeds[0] in ROW_MODULES:
                    pair = _row_pair(adapter, index, feeds[0], *row_slices[feeds[0]])
                else:
                    out_rows = (sh.q_size + 2 * sh.kv_size if target == "qkv"
                                else 2 * sh.intermediate_size)
                    pair = _column_pair(pieces_of, adapter, index, feeds, out_rows)
                if pair is None:
                    continue
                if not isinstance(owner, (Attention, MLP)):
                    raise ValueError(f"layer {index} of {model.arch.model_type} has no "
                                     f"{target} linear for LoRA adapter {name!r}")
                attr = f"lora_{target}"
                if getattr(owner, attr) is None:
                    setattr(owner, attr, LoraTarget(state))
                a, b = (t.to(device=device, dtype=dtype) for t in pair)
                getattr(owner, attr).pairs[slot] = (a, b, adapter.scaling)
