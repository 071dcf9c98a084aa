"""A worker's side of Seesaw: two layouts over the same ranks, switched on the controller's word.

At start the rank makes the process groups of both layouts (every rank makes every group, in
the same order), reads the host copy of the weights both of its partitions need, allocates one
paged-KV buffer big enough for either layout and attaches the CPU store and the prefetcher. A
switch (`reshard`) waits for the copies in flight, drops the old partition, builds the new one
from the host copy and re-views the KV buffer for the new shard (its layers x its heads; the
sequences' KV is in the CPU store across a switch, so nothing in the buffer is kept). With KV
layer groups a block is a page (kv_groups.py): the buffer is viewed as the page slots the shard's
layers use, and a store block holds its own group's layers (kv_store.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .kv_store import ShardView
from .prefetcher import Prefetcher
from .weights import HostWeights, ReshardStats, shared_norms


@dataclass
class LayoutSpec:
    """What the controller hands a Seesaw worker beside its WorkerSpec."""

    layouts: dict                 # name -> ParallelLayout (same world size)
    initial: str
    sampling_rank: int            # fixed across layouts: the sampler's per-request state stays
    store: torch.Tensor           # the shared CPU KV store (kv_store.allocate_store)
    async_swap: bool = True
    kv_groups: Optional[object] = None   # kv_groups.KVGroupLayout: blocks are pages of slots


def kv_buffer_elements(layouts: dict, rank: int, arch, num_blocks: int, block_size: int,
                       groups=None) -> int:
    """Elements of the paged buffer: the larger of the rank's shards over the layouts."""
    most = 0
    for layout in layouts.values():
        view = shard_view(layout, rank, arch, groups)
        layers, heads = view.layer_end - view.layer_start, view.head_end - view.head_start
        most = max(most, layers * 2 * num_blocks * heads * block_size * arch.head_dim)
    return most


def shard_view(layout, rank: int, arch, groups=None) -> ShardView:
    """The rank's layers (with KV layer groups: the page slots they use, one range, and each
    group's pairs of paged-cache and store slots) and heads."""
    info = layout.info(rank)
    first, end = layout.stage_range(info.stage)
    heads = arch.num_kv_heads // layout.tp
    head_range = (info.tp_rank * heads, (info.tp_rank + 1) * heads)
    if groups is None:
        return ShardView(first, end, *head_range)
    return ShardView(*groups.slot_range(first, end), *head_range,
                     group_slots=groups.copy_slots(first, end))


class LayoutSwitcher:
    def __init__(self, worker, spec: LayoutSpec, arch, notify):
        import torch.distributed as dist

        from batchinfer.engine.model.shard import TensorParallelGroup
        from batchinfer.engine.runtime.shm_allreduce import tensor_parallel_group

        self.worker, self.spec, self.arch = worker, spec, arch
        rank = worker.spec.rank
        self.tp_groups: dict[str, Optional[TensorParallelGroup]] = {}
        for name in sorted(spec.layouts):      # the same order on every rank
            layout, mine = spec.layouts[name], None
            if layout.tp > 1:
                for ranks in layout.tp_groups():
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        mine = tensor_parallel_group(group, ranks, worker.spec)
            self.tp_groups[name] = mine
        wspec = worker.spec
        partitions = [lay.info(rank).partition for lay in spec.layouts.values()]
        self.host = HostWeights.load(Path(wspec.model_dir), arch, partitions, dummy=wspec.dummy,
                                     seed=wspec.seed, pin=worker.device.type == "cuda")
        numel = kv_buffer_elements(spec.layouts, rank, arch, wspec.num_blocks, wspec.block_size,
                                   spec.kv_groups)
        self.kv_buffer = torch.zeros(numel, dtype=worker.kv_dtype, device=worker.device)
        self.prefetcher = Prefetcher(spec.store, notify, threaded=spec.async_swap)
        self.current: Optional[str] = None
        self.last_stats: Optional[ReshardStats] = None

    def enter(self, name: str):
        """-> (layout, model, kv_caches) of layout `name`, the old partition dropped first."""
        worker, wspec, arch = self.worker, self.worker.spec, self.arch
        self.prefetcher.drain()
        layout = self.spec.layouts[name]
        partition = layout.info(wspec.rank).partition
        previous = getattr(worker, "model", None)
        kept = shared_norms(previous, partition, arch) if previous is not None else {}
        worker.model = previous = None     # the old partition goes before the new one is built
        model, stats = self.host.build(arch, worker.dtype, worker.device, wspec.max_model_len,
                                       partition, self.tp_groups[name], kept=kept,
                                       quantization=wspec.quantization)
        groups = self.spec.kv_groups
        view = shard_view(layout, wspec.rank, arch, groups)
        layers, heads = view.layer_end - view.layer_start, view.head_end - view.head_start
        shape = (layers, 2, wspec.num_blocks, heads, wspec.block_size, arch.head_dim)
        paged = self.kv_buffer[: layers * 2 * wspec.num_blocks * heads * wspec.block_size
                               * arch.head_dim].view(shape)
        self.prefetcher.attach(paged, view)
        self.current, self.last_stats = name, stats
        caches = [(paged[i, 0], paged[i, 1]) for i in range(layers)]
        if groups is not None:      # each layer's pair is its slot's
            caches = groups.layer_caches(caches, partition.layer_start, partition.layer_end)
            model.use_kv_groups(groups)
        return layout, model, caches
