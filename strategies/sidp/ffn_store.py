"""The FFN weights of every layer, once per host, in shared memory (SiDP's owner buffers, §4.1).

Layer l's gate/up and down matrices live in row l of two tensors the controller allocates once and
hands to every data-parallel worker (torch shares the storage by file descriptor: no name to
collide on). Only the layer's owner writes its row, at load time; the others read it into a weight
slot when they need it, or compute from it in place (one-sided: the owner does nothing).

On CUDA the tensors live in the GPU's memory and torch.multiprocessing hands the workers CUDA IPC
handles to them (the paper exposes the owners' HBM the same way). Built for replicas that share
one GPU (parallel.gpu_transport: host): the store is one copy of every FFN on that GPU, which the
replicas read in place. Owner buffers spread over several GPUs are not built.

Layout: plain [out, in] rows, or, where the CPU kernels are built and linears are not plain
torch (the default), blocked for kernels/blocked_linear.cpp: panels of 16 output rows, [out / 16,
in, 16] (engine/model/fast_linear.py). oneDNN's packed weights, faster on AVX-512 hosts, are opaque
and cannot live in shared memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchinfer.engine.model.fast_linear import PANEL, to_blocked

TENSORS = ("gate_up", "down")


def blocked_layout_available(hidden: int, intermediate: int, dtype: torch.dtype,
                             device_type: str = "cpu") -> bool:
    """The blocked layout needs the CPU, its native kernels, fast linears on (not
    BATCHINFER_LINEAR_KERNEL = torch), fp32 and every output dimension a multiple of the panel
    width."""
    from batchinfer.engine.model.fast_linear import blocked_kernel_available, linear_kernel

    return (device_type == "cpu" and dtype == torch.float32 and hidden % PANEL == 0
            and (2 * intermediate) % PANEL == 0 and linear_kernel() != "torch"
            and blocked_kernel_available())


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ w^T for a weight in either layout."""
    if weight.dim() == 3:
        return torch.ops.batchinfer.blocked_linear(x, weight)
    return torch.nn.functional.linear(x, weight)


@dataclass
class FFNStore:
    gate_up: torch.Tensor      # [layers, 2 * intermediate, hidden]
    down: torch.Tensor         # [layers, hidden, intermediate]

    @classmethod
    def allocate(cls, num_layers: int, hidden: int, intermediate: int, dtype: torch.dtype,
                 blocked: bool = False, device: torch.device = torch.device("cpu")
                 ) -> "FFNStore":
        """Host shared memory, or on a CUDA device the allocating process's GPU memory (keep the
        store alive while the workers use it: they map it through IPC)."""
        import torch.multiprocessing  # noqa: F401  (registers the pickling of shared tensors)

        if blocked:
            shapes = ((2 * intermediate // PANEL, hidden, PANEL),
                      (hidden // PANEL, intermediate, PANEL))
        else:
            shapes = ((2 * intermediate, hidden), (hidden, intermediate))
        device = torch.device(device)
        if device.type == "cpu":
            return cls(*(torch.empty((num_layers, *shape), dtype=dtype).share_memory_()
                         for shape in shapes))
        return cls(*(torch.empty((num_layers, *shape), dtype=dtype, device=device)
                     for shape in shapes))

    @property
    def blocked(self) -> bool:
        return self.gate_up.dim() == 4

    @property
    def hidden_size(self) -> int:
        """The FFN's input (and output) width: gate_up's `in` in either layout."""
        return self.gate_up.shape[2]

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(getattr(self, name).shape[1:]) for name in TENSORS}

    def layer_bytes(self) -> int:
        return sum(getattr(self, name)[0].numel() * getattr(self, name).element_size()
                   for name in TENSORS)

    @staticmethod
    def bytes_per_layer(hidden: int, intermediate: int, dtype: torch.dtype) -> int:
        """A store's layer_bytes before it is allocated (either layout: gate/up and down)."""
        return 3 * hidden * intermediate * torch.empty((), dtype=dtype).element_size()

    def view(self, layer: int) -> dict[str, torch.Tensor]:
        """The owner's tensors of `layer`, in place."""
        return {name: getattr(self, name)[layer] for name in TENSORS}

    def write(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """The owner's weights, [out, in] each, in the store's layout."""
        if self.blocked:
            gate_up, down = to_blocked(gate_up), to_blocked(down)
        self.gate_up[layer].copy_(gate_up)
        self.down[layer].copy_(down)

    def read_into(self, layer: int, slot: dict[str, torch.Tensor]) -> None:
        """A remote read: `layer`'s weights into a slot (non-blocking when the slot is on CUDA)."""
        for name in TENSORS:
            slot[name].copy_(getattr(self, name)[layer], non_blocking=True)
