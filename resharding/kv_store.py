"""Seesaw's CPU KV store (worker side): one tensor in shared memory that every rank maps.

Layout [store_blocks, layers, 2 (K, V), kv_heads, block_size, head_dim]: within a block and a
layer the heads come first (HND), so a tensor-parallel rank's heads are one contiguous run and a
pipeline stage's layers are another. With KV layer groups (engine/kv_groups.py) a block
serves one group's table, on the device and in the store, and a sequence has a store block per
table slot of each group, as on the device. A store block then holds its own group's layers
only: its second axis counts `store_page_layers` (the largest group), layer l at its place in
its group (`KVGroupLayout.store_slot`), so a copy moves, per block, the pairs of device slot and
store slot of the block's group (`ShardView.group_slots`), and a stage whose layers share a
device slot with another stage's layers of other groups never writes their store slots. Prefill
ranks push their shard (their layers, all heads) into it; decode ranks pull theirs (all layers,
their heads): the KV is re-sharded by the copy.

The tensor is made once by the controller (`allocate_store`) and handed to the spawned workers;
torch shares its storage through a file descriptor, so there is no shared-memory name to collide.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

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
    the model (with KV layer groups: the page slots of its paged cache), kv heads
    [head_start, head_end). `group_slots` (with groups; KVGroupLayout.copy_slots): per group,
    the paged cache's slots (from layer_start) that hold the group's layers on this rank, and
    those layers' store slots."""

    layer_start: int
    layer_end: int
    head_start: int
    head_end: int
    group_slots: Optional[tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]] = None


def block_groups(table_blocks: Sequence[int]) -> list[int]:
    """A transfer's blocks, listed table after table (kv_tiers.held_blocks), -> each block's
    group (its table's index)."""
    return [group for group, count in enumerate(table_blocks) for _ in range(count)]


def groups_of_blocks(view: ShardView, device_blocks: Sequence[int],
                     table_blocks: Sequence[int]) -> list[int]:
    """block_groups of a transfer on this rank, checked against its blocks (0 for every block
    without groups)."""
    if view.group_slots is None:
        return [0] * len(device_blocks)
    groups = block_groups(table_blocks)
    if len(groups) != len(device_blocks):
        raise ValueError(f"a transfer of {len(device_blocks)} blocks lists {len(groups)} by "
                         "table")
    return groups


@functools.lru_cache(maxsize=1024)
def slot_pairs(view: ShardView, group: int) -> tuple[tuple[slice, slice], ...]:
    """(store slots, paged-cache slots) that a block of `group` moves on this rank, as runs of
    consecutive slots on both sides: the whole shard without groups, else its group's pairs
    (none where the group has no layer here)."""
    if view.group_slots is None:
        return ((slice(view.layer_start, view.layer_end), slice(None)),)
    runs: list[list[int]] = []            # [first store slot, first paged slot, length]
    for device, stored in zip(*view.group_slots[group]):
        if runs and (runs[-1][0] + runs[-1][2], runs[-1][1] + runs[-1][2]) == (stored, device):
            runs[-1][2] += 1
        else:
            runs.append([stored, device, 1])
    return tuple((slice(s, s + n), slice(d, d + n)) for s, d, n in runs)


def covers_shard(view: ShardView, group: int, slots: int) -> bool:
    """Whether a block of `group` moves every one of the rank's `slots` paged slots."""
    return view.group_slots is None or len(view.group_slots[group][0]) == slots


def swap_out(store: torch.Tensor, paged: torch.Tensor, view: ShardView,
             device_blocks: list[int], store_blocks: list[int],
             table_blocks: Sequence[int] = ()) -> None:
    """paged [local slots, 2, blocks, local heads, block_size, head_dim] -> the store's slice
    (CPU paged caches; CUDA ones go through resharding/cuda_kv_copies.py). `table_blocks`:
    the transfer's blocks per table (with groups)."""
    heads = slice(view.head_start, view.head_end)
    for rows, device, stored in _by_group(view, device_blocks, store_blocks, table_blocks):
        src = paged.index_select(2, _index(rows[0], paged.device))    # [L, 2, n, H, bs, D]
        if not isinstance(device, slice):
            src = src.index_select(0, _index(device, paged.device))
        src = src.permute(2, 0, 1, 3, 4, 5).to("cpu")
        store_rows = _index(rows[1], store.device)
        if isinstance(stored, slice):
            store[store_rows, stored, :, heads] = src
        else:
            store[store_rows[:, None], _index(stored, store.device)[None, :], :, heads] = src


def swap_in(store: torch.Tensor, paged: torch.Tensor, view: ShardView,
            device_blocks: list[int], store_blocks: list[int],
            table_blocks: Sequence[int] = ()) -> None:
    """The store's slice of this rank -> paged blocks (CPU; CUDA: cuda_kv_copies.py). Slots
    of a block that its group does not use on this rank are left as they are."""
    heads = slice(view.head_start, view.head_end)
    for rows, device, stored in _by_group(view, device_blocks, store_blocks, table_blocks):
        store_rows = _index(rows[1], store.device)
        device_rows = _index(rows[0], paged.device)
        if isinstance(stored, slice):
            src = store[store_rows, stored, :, heads]                # [n, L, 2, H, bs, D]
            paged[:, :, device_rows] = src.permute(1, 2, 0, 3, 4, 5).to(paged.device)
        else:
            src = store[store_rows[:, None], _index(stored, store.device)[None, :], :, heads]
            paged[_index(device, paged.device)[:, None], :, device_rows[None, :]] = (
                src.permute(1, 0, 2, 3, 4, 5).to(paged.device))       # [L, n, 2, H, bs, D]


def _by_group(view: ShardView, device_blocks: list[int], store_blocks: list[int],
              table_blocks: Sequence[int]):
    """-> ((device blocks, store blocks), paged slots, store slots) per group with layers on
    this rank: slices without groups, index lists with them."""
    if view.group_slots is None:
        yield (device_blocks, store_blocks), slice(None), slice(view.layer_start, view.layer_end)
        return
    groups = groups_of_blocks(view, device_blocks, table_blocks)
    for group, (device, stored) in enumerate(view.group_slots):
        rows = [i for i, g in enumerate(groups) if g == group]
        if device and rows:
            yield (([device_blocks[i] for i in rows], [store_blocks[i] for i in rows]),
                   list(device), list(stored))


def _index(blocks: list[int], device) -> torch.Tensor:
    return torch.tensor(blocks, dtype=torch.long, device=device)
