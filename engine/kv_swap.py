"""Preemption by swapping (`memory.preemption_mode: swap`, vLLM's swap mode): a preempted
sequence's KV is copied to a swap area in host memory and back, instead of being dropped and
its prompt and replies recomputed.

Controller side, `SwapSpace` allocates the swap area's blocks (a BlockManager with no tensors)
and records each copy as it is decided; the copies ride on the next micro-batch's plan
(`StepPlan.kv_swaps`) and every rank carries them out on its own layers and heads before that
plan's forward (`apply_kv_swaps`). Ranks run plans in order, so a copy out of blocks lands after
every earlier plan that wrote them and before any later plan reuses them, and a copy in lands
before the first plan that reads them: no extra synchronisation. The copies run in the order
they were decided, because a block freed by one can be taken by the next (a device block freed
by a swap out and taken by a swap in, a swap-area block freed by a swap in and taken by a swap
out).

A sequence holding one block table over every layer swaps; with KV layer groups or a sliding
window released behind it, or under a scheduler that does not bring swapped sequences back
(`swaps_preempted` false), the engine keeps recomputing (`swap_unsupported_reason`).
"""
from __future__ import annotations

import logging
from typing import Hashable, Optional

import torch

from .errors import ConfigError
from .kv_cache import BlockManager

log = logging.getLogger("batchinfer")

SWAP_OUT, SWAP_IN = "out", "in"


class SwapSpace:
    """One replica's swap area: its allocator and the copies not yet handed to a plan."""

    def __init__(self, num_blocks: int, block_size: int):
        self.store = BlockManager(num_blocks, block_size, watermark=0.0)
        self.num_blocks, self.block_size = num_blocks, block_size
        self._ops: list[tuple[str, int, int]] = []      # (kind, source block, destination block)
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.swapped_out_tokens = 0
        self.peak_blocks = 0                            # the most swap-area blocks held at once

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_swap_out(self, num_tokens: int) -> bool:
        return 0 < self.blocks_for(num_tokens) <= self.store.num_free_blocks

    def swap_out(self, device: BlockManager, seq_id: Hashable, num_tokens: int) -> None:
        """Moves the KV of `seq_id`'s first `num_tokens` tokens into the swap area and frees its
        device blocks (a block it shares through prefix caching stays with its other holders)."""
        count = self.blocks_for(num_tokens)
        source = device.block_table(seq_id)[:count]
        if len(source) < count:
            raise ValueError(f"{seq_id!r} holds {len(source)} KV blocks, fewer than its "
                             f"{num_tokens} tokens need")
        dest = self.store.grow(seq_id, num_tokens)
        self._ops.extend((SWAP_OUT, s, d) for s, d in zip(source, dest))
        device.free(seq_id)
        self.num_swap_outs += 1
        self.swapped_out_tokens += num_tokens
        self.peak_blocks = max(self.peak_blocks, self.num_blocks - self.store.num_free_blocks)

    def swap_in(self, device: BlockManager, seq_id: Hashable, num_tokens: int) -> None:
        """Gives `seq_id` (holding no device blocks) fresh device blocks for its swapped KV and
        frees its swap-area blocks. The caller checked the device has room."""
        source = self.store.block_table(seq_id)
        dest = device.grow(seq_id, num_tokens)
        self._ops.extend((SWAP_IN, s, d) for s, d in zip(source, dest))
        self.store.free(seq_id)
        self.num_swap_ins += 1

    def discard(self, seq_id: Hashable) -> None:
        """A swapped sequence is aborted: its swap-area blocks go back."""
        self.store.free(seq_id)

    def take_ops(self) -> list[tuple[str, int, int]]:
        """The copies decided since the last call, in order (for the next plan)."""
        ops, self._ops = self._ops, []
        return ops

    def summary(self) -> dict:
        return {"swap_outs": self.num_swap_outs, "swap_ins": self.num_swap_ins,
                "swapped_out_tokens": self.swapped_out_tokens,
                "swap_blocks": self.num_blocks, "peak_swap_blocks": self.peak_blocks}


def swap_unsupported_reason(block_manager: BlockManager, scheduler) -> Optional[str]:
    """Why this replica cannot swap (None: it can)."""
    if block_manager.num_groups > 1:
        return "the model's KV layer groups (sliding-window layers beside global ones)"
    if block_manager.window:
        return "blocks released behind the sliding window"
    if not getattr(scheduler, "swaps_preempted", False):
        return f"a scheduler that only recomputes ({type(scheduler).__name__})"
    return None


def swap_area_used(config, arch, groups=None) -> bool:
    """Whether memory.preemption_mode: swap gets a swap area under `config` (EngineConfig) for a
    model of `arch` run with KV layer `groups` (kv_groups.groups_for): swap_unsupported_reason's
    checks, made from the config before the replica exists (the automatic CPU KV budget leaves
    the area's memory out only where there will be one; a strategy says whether its scheduler
    swaps with `StrategyParams.swaps_preempted`)."""
    strategy = getattr(config, "strategy", None)
    return (bool(config.cache.swap_bytes) and groups is None and not config.cache.kv_window(arch)
            and (strategy is None or strategy.swaps_preempted))


def swap_blocks_for(cache, bytes_per_block: int) -> int:
    """Blocks of the swap area `cache` (the CacheConfig) asks for, a block being
    `bytes_per_block` of K/V over all a replica's ranks (0: preemption_mode recompute)."""
    if not cache.swap_bytes:
        return 0
    blocks = cache.swap_bytes // bytes_per_block
    if blocks < 1:
        raise ConfigError(f"memory.swap_space ({cache.swap_bytes} bytes) holds no KV block "
                          f"({bytes_per_block} bytes); raise it or use preemption_mode: recompute")
    return blocks


def attach_swap_space(block_manager: BlockManager, scheduler, num_blocks: int) -> int:
    """Gives a replica's block manager a swap area of `num_blocks` blocks (swap_blocks_for)
    where the replica can swap. -> its blocks (0: preempted sequences are recomputed)."""
    if not num_blocks:
        return 0
    reason = swap_unsupported_reason(block_manager, scheduler)
    if reason is not None:
        log.warning("memory.preemption_mode: swap is not available with %s; preempted "
                    "sequences are recomputed", reason)
        return 0
    block_manager.swap = SwapSpace(num_blocks, block_manager.block_size)
    return num_blocks


def allocate_swap_area(kv_caches: list, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Host tensors shaped as this rank's (key, value) caches with `num_blocks` blocks. On a CPU
    (torch.empty) pages are only taken as blocks are swapped; for a GPU's cache the area is
    pinned, which commits it, so the executors allocate it when the first copy comes."""
    if not kv_caches or num_blocks <= 0:
        return []
    k0 = kv_caches[0][0]
    pin = k0.device.type == "cuda"
    storage = torch.empty((len(kv_caches), 2, num_blocks, *k0.shape[1:]), dtype=k0.dtype,
                          pin_memory=pin)
    return [(storage[layer, 0], storage[layer, 1]) for layer in range(len(kv_caches))]


class SwapArea:
    """A rank's share of the swap area, allocated when the first copy comes (pinned on a GPU,
    which commits the memory); the in-process executors and the workers run plans' copies
    through it."""

    def __init__(self, num_blocks: int = 0):
        self.num_blocks = num_blocks
        self.tensors: list = []

    def run(self, ops: list[tuple[str, int, int]], kv_caches: list) -> None:
        """A plan's copies, before its forward."""
        if ops and not self.tensors:
            self.tensors = allocate_swap_area(kv_caches, self.num_blocks)
        apply_kv_swaps(ops, kv_caches, self.tensors)


def apply_kv_swaps(ops: list[tuple[str, int, int]], kv_caches: list, area: list) -> None:
    """Carries out a plan's copies on this rank's layers, in order; consecutive copies of one
    kind go together (one gather and one scatter per layer and tensor)."""
    if not ops:
        return
    if not area:
        raise RuntimeError("a plan carries KV swaps but this rank has no swap area")
    device = kv_caches[0][0].device
    start = 0
    while start < len(ops):
        kind = ops[start][0]
        end = start
        while end < len(ops) and ops[end][0] == kind:
            end += 1
        src = torch.tensor([op[1] for op in ops[start:end]], dtype=torch.long)
        dst = torch.tensor([op[2] for op in ops[start:end]], dtype=torch.long)
        for cache, store in zip(kv_caches, area):
            for part in (0, 1):
                if kind == SWAP_OUT:
                    store[part][dst] = cache[part][src.to(device)].to("cpu")
                else:
                    cache[part][dst.to(device)] = store[part][src].to(device)
        start = end
