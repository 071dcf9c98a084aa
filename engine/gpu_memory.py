"""The KV cache's size on a GPU, as vLLM sizes it: a share of the card's whole memory
(`cache.memory_utilization`, vLLM's gpu_memory_utilization, default 0.9) minus the weights, the
peak of a profiled forward over the largest step the scheduler can plan, and whatever else holds
memory on the card (the CUDA context, other processes).

The profiled step is `max_num_batched_tokens` prompt tokens (in sequences no longer than
max_model_len) through the model over a small temporary KV cache, then the LM head over
`max_num_seqs` rows and the sampler's largest working set on them (a sort and a float64 softmax
with its cumulative sum). The CUDA graphs' memory pool, captured later, is not counted: it comes
out of the share memory_utilization leaves free. A model that leaves too little for
max_model_len tokens of KV is refused before any request runs, with every number that went in.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from .errors import ConfigError

log = logging.getLogger(__name__)
GiB = 2**30


@dataclass(frozen=True)
class GpuMemory:
    """Bytes, as measured after the weights were loaded and the profiled step ran."""

    total: int                 # the card's memory
    weights: int               # what torch holds for this engine before the step (weights, buffers)
    activation_peak: int       # the profiled step's peak above that
    other: int                 # held outside this process's torch allocator (context, other jobs)

    def kv_budget(self, utilization: float) -> int:
        return int(self.total * utilization) - self.weights - self.activation_peak - self.other

    def describe(self, utilization: float) -> str:
        return (f"{self.total / GiB:.1f} GiB x memory_utilization {utilization} = "
                f"{self.total * utilization / GiB:.1f} GiB, less weights {self.weights / GiB:.2f} GiB, "
                f"activation peak {self.activation_peak / GiB:.2f} GiB and memory held elsewhere "
                f"{self.other / GiB:.2f} GiB")


def kv_budget_on_gpu(memory: GpuMemory, utilization: float, asked: Optional[int],
                     min_bytes: int, what_min: str) -> int:
    """The KV bytes to allocate: `asked` (cache.kv_cache_memory) when set and it fits, else what
    utilization leaves. Raises ConfigError with the numbers when the KV can't hold `min_bytes`
    (max_model_len tokens, `what_min` says so) or `asked` does not fit."""
    room = memory.kv_budget(utilization)
    log.info("GPU memory: %s leaves %.2f GiB for the KV cache", memory.describe(utilization),
             max(room, 0) / GiB)
    if asked is not None:
        fits = memory.total - memory.weights - memory.activation_peak - memory.other
        if asked > fits:
            raise ConfigError(f"memory.kv_cache_memory {asked / GiB:.2f} GiB does not fit on the "
                              f"GPU: {memory.total / GiB:.1f} GiB total, less weights "
                              f"{memory.weights / GiB:.2f} GiB, activation peak "
                              f"{memory.activation_peak / GiB:.2f} GiB and memory held elsewhere "
                              f"{memory.other / GiB:.2f} GiB leaves {fits / GiB:.2f} GiB")
        return asked
    if room < min_bytes:
        raise ConfigError(f"the model does not fit the GPU with the KV cache it needs: "
                          f"{memory.describe(utilization)} leaves {max(room, 0) / GiB:.2f} GiB for "
                          f"the KV cache; {what_min} need {min_bytes / GiB:.2f} GiB. Raise "
                          "memory.memory_utilization, lower model.max_model_len or "
                          "scheduler.max_num_batched_tokens, or use a smaller model")
    return room


def profile_step(model, backend, arch, max_tokens: int, max_seqs: int, max_model_len: int,
                 block_size: int, kv_dtype: torch.dtype, device: torch.device) -> int:
    """Runs the largest step once; -> bytes of the temporary KV cache it used (the caller's
    peak measurement subtracts them). Device-agnostic: the tests run it on CPU."""
    from .attention import AttentionMetadata
    from .kv_cache import KVCacheSpec, allocate_kv_tensors

    lengths = []
    left = max_tokens
    while left > 0:
        lengths.append(min(left, max_model_len))
        left -= lengths[-1]
    tables, next_block = [], 0
    for n in lengths:
        blocks = -(-n // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    spec = KVCacheSpec(arch.num_layers, next_block, block_size, arch.num_kv_heads, arch.head_dim,
                       kv_dtype.itemsize)
    kv = allocate_kv_tensors(spec, kv_dtype, device)
    meta = AttentionMetadata.build(lengths, lengths, tables, block_size, device)
    tokens = sum(lengths)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    with torch.inference_mode():
        hidden, residual = model(ids, positions, kv, meta, backend)
        rows = torch.arange(max_seqs, device=device) % tokens
        logits = model.compute_logits(hidden[rows], None if residual is None else residual[rows])
        # the sampler's largest working set (sampler.sample_torch with top-p: a penalised copy,
        # the sorted values and their indices, a float64 softmax and its cumulative sum)
        scaled = logits.float().clone()
        ordered = scaled.sort(dim=-1, descending=True)
        torch.softmax(scaled, dim=-1, dtype=torch.float64).cumsum(dim=-1)
        del ordered
    model.take_expert_load_on_device()     # a mixture of experts: the probe's routing is no step's
    del kv
    return spec.num_blocks * spec.bytes_per_block


def measure(model, backend, arch, max_tokens: int, max_seqs: int, max_model_len: int,
            block_size: int, kv_dtype: torch.dtype, device: torch.device) -> GpuMemory:
    """The card's memory around one profiled step (CUDA only)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    temp_kv = profile_step(model, backend, arch, max_tokens, max_seqs, max_model_len, block_size,
                           kv_dtype, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights - temp_kv
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    other = max(0, total - free - torch.cuda.memory_reserved(device))
    return GpuMemory(total=total, weights=weights, activation_peak=max(0, peak), other=other)
