"""The FFN weights of every layer, once per host, in shared memory (SiDP's owner buffers, §4.1).

Layer l's gate/up and down matrices live in row l of two tensors the controller allocates once and
hands to every data-parallel worker (torch shares the storage by file descriptor: no name to
collide on). Only the layer's owner writes its row, at load time; the others read it into a weight
slot when they need it (one-sided: the owner does nothing). On CUDA the paper exposes the owner's
HBM through IPC handles instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TENSORS = ("gate_up", "down")


@dataclass
class FFNStore:
    gate_up: torch.Tensor      # [layers, 2 * intermediate, hidden]
    down: torch.Tensor         # [layers, hidden, intermediate]

    @classmethod
    def allocate(cls, num_layers: int, hidden: int, intermediate: int,
                 dtype: torch.dtype) -> "FFNStore":
        import torch.multiprocessing  # noqa: F401  (registers the pickling of shared tensors)

        return cls(torch.empty((num_layers, 2 * intermediate, hidden), dtype=dtype).share_memory_(),
                   torch.empty((num_layers, hidden, intermediate), dtype=dtype).share_memory_())

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(getattr(self, name).shape[1:]) for name in TENSORS}

    def layer_bytes(self) -> int:
        return sum(getattr(self, name)[0].numel() * getattr(self, name).element_size()
                   for name in TENSORS)

    def view(self, layer: int) -> dict[str, torch.Tensor]:
        """The owner's tensors of `layer`, in place."""
        return {name: getattr(self, name)[layer] for name in TENSORS}

    def write(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up[layer].copy_(gate_up)
        self.down[layer].copy_(down)

    def read_into(self, layer: int, slot: dict[str, torch.Tensor]) -> None:
        """A remote read: `layer`'s weights into a slot (non-blocking when the slot is on CUDA)."""
        for name in TENSORS:
            slot[name].copy_(getattr(self, name)[layer], non_blocking=True)
