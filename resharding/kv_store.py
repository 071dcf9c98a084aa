"""Seesaw's CPU KV store (worker side): one tensor in shared memory that every rank maps.

Layout [store_blocks, layers, 2 (K, V), kv_heads, block_size, head_dim]: within a block and a
layer the heads come first (HND), so a tensor-parallel rank's heads are one contiguous run and a
pipeline stage's layers are another. With KV layer groups (engine/kv_groups.py) a block is a
page: its second axis is the page's slots, and a sequence has a store block per table slot of
each group, as on the device. Prefill ranks push their shard (their layers, all heads)
into it; decode ranks pull theirs (all layers, their heads): the KV is re-sharded by the copy.

The tensor is made once by the controller (`allocate_store`) and handed to the spawned workers;
torch shares its storage through a file descriptor, so there is no shared-memory name to collide.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def store_shape(num_blocks: int, num_layers: int, num_kv_heads: int, block_size: int,
                head_dim: int) -> tuple[int, ...]:
    return (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)


def allocate_store(num_blocks: int, num_layers: int, num_kv_heads: int, block_size: int,
                   head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    import torch.multiprocessing  # noqa: F401  (registers the pickling of shared tensors)

    shape = store_shape(num_blocks, num_layers, num_kv_heads, block_size, head_dim)
    return torch.zeros(shape, dtype=dtype).share_memory_()


@dataclass(frozen=True)
class ShardView:
    """What a rank holds of the KV in the current layout: layers [layer_start, layer_end) of
    the model (with KV layer groups: page slots, as the store's second axis then counts them),
    kv heads [head_start, head_end)."""

    layer_start: int
    layer_end: int
    head_start: int
    head_end: int


def swap_out(store: torch.Tensor, paged: torch.Tensor, view: ShardView,
             device_blocks: list[int], store_blocks: list[int]) -> None:
    """paged [local layers, 2, blocks, local heads, block_size, head_dim] -> the store's slice
    (CPU paged caches; CUDA ones go through resharding/cuda_kv_copies.py)."""
    src = paged[:, :, _index(device_blocks, paged.device)]          # [L, 2, n, H, bs, D]
    src = src.permute(2, 0, 1, 3, 4, 5).to("cpu")
    store[_index(store_blocks, store.device), view.layer_start:view.layer_end, :,
          view.head_start:view.head_end] = src


def swap_in(store: torch.Tensor, paged: torch.Tensor, view: ShardView,
            device_blocks: list[int], store_blocks: list[int]) -> None:
    """The store's slice of this rank -> paged blocks (CPU; CUDA: cuda_kv_copies.py)."""
    src = store[_index(store_blocks, store.device), view.layer_start:view.layer_end, :,
                view.head_start:view.head_end]                       # [n, L, 2, H, bs, D]
    paged[:, :, _index(device_blocks, paged.device)] = src.permute(1, 2, 0, 3, 4, 5).to(paged.device)


def _index(blocks: list[int], device) -> torch.Tensor:
    return torch.tensor(blocks, dtype=torch.long, device=device)
