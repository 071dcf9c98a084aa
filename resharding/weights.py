"""Weight re-sharding (Seesaw §4.1): each rank keeps a host copy of the weights its layouts need
and, at every switch, builds the new layout's partition from it.

The host copy holds whole Hugging Face tensors, read once at start from the safetensors (or made
from the dummy seed), pinned on CUDA so the copy to the device can overlap. A re-shard builds the
new partition's fused parameters from their slices (shard.py's split, the same code the direct
loader runs, so a re-sharded rank equals a directly loaded one) and keeps the norms the two
partitions share instead of copying them again. The old partition is dropped first, so a rank
never holds both.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch

from batchinfer.engine.model.arch import ModelArch
from batchinfer.engine.model.causal_lm import CausalLM, ModelPartition
from batchinfer.engine.model.loader import (_Filler, _read_weights, _Target, dummy_tensor,
                                            empty_partition, finish_partition, hf_tensor_shapes,
                                            safetensor_files)
from batchinfer.engine.model.shard import TensorParallelGroup

log = logging.getLogger(__name__)


@dataclass
class ReshardStats:
    seconds: float
    bytes_from_host: int
    bytes_kept: int


class _Collect:
    """Stands in for the loader's filler: takes every tensor some partition needs, whole."""

    def __init__(self, wanted: set[str]):
        self.wanted, self.tensors = wanted, {}

    def targets(self, name: str) -> list:
        return [_Target("whole")] if name in self.wanted else []   # no slice: the whole tensor

    def check_source_shape(self, name, shape, where) -> None:
        pass

    def put(self, name: str, tensor: torch.Tensor, where=None) -> None:
        self.tensors[name] = tensor.to(torch.float32)


def needed_names(arch: ModelArch, partitions: Iterable[ModelPartition],
                 quantized: bool = True) -> set[str]:
    """The Hugging Face tensors any of `partitions` reads (a TP shard reads its slice of each);
    `quantized` false: a quantized checkpoint's tensors in their de-quantized form (dummy)."""
    names = set()
    for partition in partitions:
        with torch.device("meta"):   # shapes only: nothing is allocated
            filler = _Filler(CausalLM(arch, 16, partition, ShapeOnlyGroup(partition)))
        names.update(name for name, _ in hf_tensor_shapes(arch, quantized)
                     if filler.targets(name))
    return names


def host_copy_bytes(arch: ModelArch, partitions: Iterable[ModelPartition],
                    dummy: bool = False) -> int:
    """What HostWeights.load keeps for a rank running `partitions`: the whole tensors any of
    them reads, each value in fp32 (an MXFP4 checkpoint's tensors as stored, packed codes and
    scales; dummy weights de-quantized, as they are drawn)."""
    quantized = not dummy
    partitions = list(partitions)
    wanted = needed_names(arch, partitions, quantized=quantized)
    total = 0
    for name, shape in hf_tensor_shapes(arch, quantized=quantized):
        if name in wanted:
            count = 1
            for size in shape:
                count *= size
            total += 4 * count
    return total


class ShapeOnlyGroup(TensorParallelGroup):
    """Rank and size of a partition, for building its (unfilled) modules to ask what it reads;
    the collectives are never called."""

    def __init__(self, partition: ModelPartition):
        self.group, self.rank, self.size = None, partition.tp_rank, partition.tp_size


class HostWeights:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @classmethod
    def load(cls, model_dir: Path, arch: ModelArch, partitions: list[ModelPartition],
             dummy: bool = False, seed: int = 0, pin: bool = False) -> "HostWeights":
        wanted = needed_names(arch, partitions, quantized=not dummy)
        collect = _Collect(wanted)
        if dummy:   # drawn de-quantized, as the loader draws them
            for name, shape in hf_tensor_shapes(arch, quantized=False):
                if name in wanted:
                    collect.put(name, dummy_tensor(name, shape, seed))
        else:
            _read_weights(safetensor_files(model_dir), collect, arch, str(model_dir))
        missing = wanted - set(collect.tensors)
        if missing:
            raise ValueError(f"{model_dir}: weights missing for {', '.join(sorted(missing)[:6])}")
        tensors = collect.tensors
        if pin:
            tensors = {k: v.pin_memory() for k, v in tensors.items()}
        return cls(tensors)

    def build(self, arch: ModelArch, dtype: torch.dtype, device: torch.device,
              max_positions: int, partition: ModelPartition,
              tp_group: Optional[TensorParallelGroup] = None,
              kept: Optional[dict] = None, quantization=None) -> tuple[CausalLM, ReshardStats]:
        """The partition, filled from the host copy except for `kept` (HF name -> tensor the
        rank already holds, from `shared_norms`); quantization: model.quantization's linears."""
        t0 = time.perf_counter()
        kept = kept or {}
        model, filler = empty_partition(arch, max_positions, partition, tp_group)
        from_host = 0
        with torch.no_grad():
            for name, tensor in self.tensors.items():
                for where in filler.targets(name):
                    if name in kept:
                        filler.put(name, kept[name], where, stored=True)
                        continue
                    part = where.take(tensor)
                    filler.put(name, part, where)
                    from_host += part.numel() * part.element_size()
            filler.check_complete("the host copy of the weights")
        model = finish_partition(model, device, dtype, quantization=quantization)
        kept_bytes = sum(t.numel() * t.element_size() for t in kept.values())
        return model, ReshardStats(time.perf_counter() - t0, from_host, kept_bytes)


def shared_norms(previous: CausalLM, partition: ModelPartition, arch: ModelArch) -> dict:
    """HF name -> (a host copy of) the RMSNorm weights `previous` holds that `partition` holds
    whole too (TP replicates norms), so they survive dropping `previous`."""
    old = previous.partition
    new = partition.resolve(arch.num_layers)
    kept = {}
    for index in range(max(old.layer_start, new.layer_start), min(old.layer_end, new.layer_end)):
        layer = previous.layers[index - old.layer_start]
        for norm in layer.NORMS:
            kept[f"model.layers.{index}.{norm}.weight"] = getattr(layer, norm).weight
    if previous.norm is not None and new.is_last(arch.num_layers):
        kept["model.norm.weight"] = previous.norm.weight
    return {name: t.detach().to("cpu", torch.float32, copy=True) for name, t in kept.items()}
