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
from torch import nn

from .compute_service import ComputeService, ffn
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
    compute_service: bool = True  # CaS rounds may come (the rank posts P2P transfers for them)
    gemm_fusion: bool = True
    profile_costs: bool = False  # measure what B_th is derived from (cost_profile.py)


class SharedMLP(nn.Module):
    def __init__(self, layer: int, store: FFNStore, slots: Optional[WeightSlots],
                 service: Optional[ComputeService], timeout_s: float):
        super().__init__()
        self.layer, self.store, self.slots, self.timeout_s = layer, store, slots, timeout_s
        self.service = service

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        if self.service is not None and self.service.active:   # a CaS round
            return self.service.forward(self.layer, x, ops)
        if self.slots is None:                          # the store's rows, in place
            return ffn(x, self.store.view(self.layer), ops)
        weights = self.slots.acquire(self.layer, self.timeout_s)
        try:
            return ffn(x, weights, ops)
        finally:
            self.slots.release(self.layer)


class RankFFN:
    """A rank's SiDP state: its weight slots (WaS) and its compute service (CaS), and the counters
    it reports to the controller."""

    def __init__(self, slots: WeightSlots, service: Optional[ComputeService]):
        self.slots, self.service = slots, service

    def begin(self, plan) -> None:
        """Before a forward: a plan with `cas_rows` is this replica's part of a CaS round."""
        rows = getattr(plan, "cas_rows", None)
        if rows:
            self.service.begin(rows)

    def end(self) -> None:
        if self.service is not None and self.service.active:
            self.service.end()

    def serve(self, plan, ops) -> None:
        """A dummy plan: no model, only the owned layers served (§4.3, dummy skipping)."""
        self.service.serve_round(plan.cas_rows, ops)

    def stats(self) -> dict:
        out = {"weight_slots": vars(self.slots.stats).copy()}
        if self.service is not None:
            out["compute_service"] = vars(self.service.stats).copy()
        return out

    def start(self) -> None:
        self.slots.start()

    def close(self) -> None:
        self.slots.close()


def install_shared_ffn(model, spec: SiDPWorkerSpec, rank: int, device: torch.device,
                       timeout_s: float, start: bool = True) -> RankFFN:
    """Owned layers -> the store; every MLP -> a SharedMLP; -> the rank's slots and service (the
    slots' prefetch thread starts only once every owner has written: after a barrier)."""
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
    service = (ComputeService(rank, spec.owners, spec.store, device, spec.gemm_fusion)
               if spec.compute_service else None)
    for index, layer in enumerate(layers):
        in_place = spec.owners[index] == rank or not spec.weight_slots
        layer.mlp = SharedMLP(index, spec.store, None if in_place else slots, service, timeout_s)
    return RankFFN(slots, service)
