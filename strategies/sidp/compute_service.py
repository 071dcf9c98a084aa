"""Compute as a Service, a rank's side (§4.3): in the small-batch tail activations go to the weights.

Every replica runs the same CaS rounds in the same order (the controller sends each round to all
of them, `rows` saying how many tokens each brings; 0: a dummy that brings nothing). In a round:
- at a layer it does not own, a replica sends its FFN input to the owner and receives the output;
- at a layer it owns, a replica receives the others' inputs, concatenates them behind its own and
  runs one GEMM chain over all of them (GEMM fusion), then returns each replica its slice;
- a dummy replica runs no model: it only serves the layers it owns, and only to replicas that
  bring rows (dummy skipping: no transfer, no compute for work that is not there).
All receives of a round are posted when it begins, so transfers overlap the layers before them.
Transfers go through the runtime's point-to-point messages (engine/runtime/transport.py: gloo
on CPU), tagged with the layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from batchinfer.engine.runtime import transport

from .ffn_store import FFNStore, linear


@dataclass
class ServiceStats:
    rounds: int = 0              # CaS rounds this rank ran with work of its own
    dummy_rounds: int = 0        # ... and as a dummy (serving only)
    activations_sent: int = 0    # own FFN inputs sent to owners
    outputs_returned: int = 0    # FFN outputs sent back to the replicas that brought them
    bytes_sent: int = 0
    rows_served: int = 0         # other replicas' rows this rank computed as the owner
    fused_gemms: int = 0         # owner-side FFN computations over more than one replica's rows


def ffn(x: torch.Tensor, weights: dict[str, torch.Tensor], ops) -> torch.Tensor:
    """The MLP's arithmetic (llama.py's MLP), on weights from wherever they live, in the store's
    layout."""
    return linear(ops.silu_and_mul(linear(x, weights["gate_up"])), weights["down"])


class ComputeService:
    def __init__(self, replica: int, owners: list[int], store: FFNStore, device: torch.device,
                 gemm_fusion: bool = True):
        # strategy sidp runs tp 1, pp 1: replica r is process-group rank r
        self.replica, self.owners, self.store = replica, owners, store
        self.dtype, self.device, self.gemm_fusion = store.gate_up.dtype, device, gemm_fusion
        self.hidden = store.hidden_size
        self.stats = ServiceStats()
        self.rows: Optional[list[int]] = None
        self._inputs: dict[int, list] = {}    # owned layer -> [(peer, buffer, work)]
        self._outputs: dict[int, tuple] = {}  # remote layer -> (buffer, work)

    @property
    def active(self) -> bool:
        return self.rows is not None

    # --- a round --------------------------------------------------------------------------------
    def begin(self, rows: list[int], dummy: bool = False) -> None:
        """Starts a round: posts every receive it will need (peers' inputs for the layers this
        rank owns, the owners' outputs for the others)."""
        self.rows = list(rows)
        mine = rows[self.replica]
        if dummy:
            self.stats.dummy_rounds += 1
        else:
            self.stats.rounds += 1
        for layer, owner in enumerate(self.owners):
            if owner == self.replica:
                self._inputs[layer] = [(peer, *self._recv(n, peer, layer))
                                       for peer, n in enumerate(rows)
                                       if peer != self.replica and n > 0]
            elif mine:
                self._outputs[layer] = self._recv(mine, owner, layer)

    def end(self) -> None:
        if any(self._inputs.values()) or self._outputs:
            raise RuntimeError("a CaS round ended with transfers not taken: the ranks disagree "
                               "on the round's layers")
        self.rows = None
        self._inputs.clear()

    def forward(self, layer: int, x: Optional[torch.Tensor], ops) -> Optional[torch.Tensor]:
        """The FFN of `layer` on this rank's rows `x` (None: a dummy serving as the owner)."""
        owner = self.owners[layer]
        if owner == self.replica:
            return self._serve(layer, x, ops)
        x = x.contiguous()
        send = transport.isend(x, owner, tag=layer)
        out, work = self._outputs.pop(layer)
        send.wait()
        work.wait()
        self.stats.activations_sent += 1
        self.stats.bytes_sent += x.numel() * x.element_size()
        return out

    def serve_round(self, rows: list[int], ops) -> None:
        """A dummy's round: serve the owned layers to the replicas that bring rows; bring nothing.
        rows[self] > 0 here is the ablation without dummy skipping: zero rows through every layer."""
        self.begin(rows, dummy=True)
        mine = rows[self.replica]
        zeros = torch.zeros((mine, self.hidden), dtype=self.dtype, device=self.device)
        for layer, owner in enumerate(self.owners):
            if mine:
                self.forward(layer, zeros, ops)
            elif owner == self.replica:
                self._serve(layer, None, ops)     # nothing to do when nobody brought rows
        self.end()

    # --- the owner's side -----------------------------------------------------------------------
    def _serve(self, layer: int, x: Optional[torch.Tensor], ops) -> Optional[torch.Tensor]:
        incoming = self._inputs.pop(layer, [])
        weights = self.store.view(layer)
        for _, _, work in incoming:
            work.wait()
        chunks = ([x] if x is not None else []) + [buffer for _, buffer, _ in incoming]
        if not chunks:
            return None
        if self.gemm_fusion and len(chunks) > 1:
            outs = ffn(torch.cat(chunks), weights, ops).split([c.shape[0] for c in chunks])
            self.stats.fused_gemms += 1
        else:
            outs = [ffn(chunk, weights, ops) for chunk in chunks]
        local = outs[0] if x is not None else None
        returned = outs[1:] if x is not None else outs
        sends = []
        for (peer, buffer, _), out in zip(incoming, returned):
            out = out.contiguous()
            sends.append(transport.isend(out, peer, tag=layer))
            self.stats.outputs_returned += 1
            self.stats.bytes_sent += out.numel() * out.element_size()
            self.stats.rows_served += buffer.shape[0]
        for send in sends:
            send.wait()
        return local

    def _recv(self, rows: int, peer: int, layer: int) -> tuple[torch.Tensor, object]:
        buffer = torch.empty((rows, self.hidden), dtype=self.dtype, device=self.device)
        return buffer, transport.irecv(buffer, peer, tag=layer)
