"""A data-parallel rank's FFN layers under SiDP (§4.1): the FFN forward is intercepted, the
numerics are unchanged, only where the weights live changes.

At load time every rank has the whole model; then the owner of each layer writes its FFN weights
into the shared store, every rank drops its own FFN parameters, and each layer's MLP is replaced
by a SharedMLP that reads the weights from the store (owned layers, in place) or from a weight
slot (other layers: fetched ahead by WeightSlots, released right after the layer's GEMMs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .ffn_store import FFNStore
from .ownership import prefetch_order, weight_slots
from .weight_slots import WeightSlots


@dataclass
class SiDPWorkerSpec:
    """What a worker needs: the shared store, the owner map, and its prefetch settings."""

    store: FFNStore
    owners: list[int]
    dp: int
    peak_shifting: bool = True
    weight_slots: bool = True    # false: remote layers compute from the owner's rows in place


class SharedMLP(nn.Module):
    def __init__(self, layer: int, store: FFNStore, slots: Optional[WeightSlots],
                 timeout_s: float):
        super().__init__()
        self.layer, self.store, self.slots, self.timeout_s = layer, store, slots, timeout_s

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        if self.slots is None:                          # the store's rows, in place
            return _ffn(x, self.store.view(self.layer), ops)
        weights = self.slots.acquire(self.layer, self.timeout_s)
        try:
            return _ffn(x, weights, ops)
        finally:
            self.slots.release(self.layer)


def _ffn(x: torch.Tensor, weights: dict[str, torch.Tensor], ops) -> torch.Tensor:
    """The MLP's arithmetic (llama.py's MLP), on weights from wherever they live."""
    return F.linear(ops.silu_and_mul(F.linear(x, weights["gate_up"])), weights["down"])


def install_shared_ffn(model, spec: SiDPWorkerSpec, rank: int, device: torch.device,
                       timeout_s: float, start: bool = True) -> WeightSlots:
    """Owned layers -> the store; every MLP -> a SharedMLP; -> the rank's weight slots (start
    their prefetch thread only once every owner has written: after a barrier)."""
    layers = model.layers
    if len(layers) != len(spec.owners):
        raise ValueError(f"SiDP needs every layer on every rank (got {len(layers)} of "
                         f"{len(spec.owners)}): parallel.tp and parallel.pp must be 1")
    for index, layer in enumerate(layers):
        if spec.owners[index] == rank:
            spec.store.write(index, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight)
    order = (prefetch_order(rank, spec.owners, spec.dp, spec.peak_shifting)
             if spec.weight_slots else [])
    slots = WeightSlots(spec.store, order,
                        weight_slots(rank, spec.owners, spec.dp, spec.weight_slots), device,
                        start=start)
    for index, layer in enumerate(layers):
        in_place = spec.owners[index] == rank or not spec.weight_slots
        layer.mlp = SharedMLP(index, spec.store, None if in_place else slots, timeout_s)
    return slots
