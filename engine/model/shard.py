"""How a model is split across tensor-parallel ranks (Megatron-style).

Column-parallel: qkv_proj (each rank holds whole q/k/v heads) and gate_up_proj (a contiguous
block of intermediate rows). Row-parallel: o_proj and down_proj (the matching input columns),
followed by an all-reduce. A mixture of experts is split the same way inside every expert (each
rank holds every expert's block of intermediate rows; the router is replicated), so every rank
routes the same tokens, does an equal share of each expert's work whatever the load, and one
all-reduce after the experts sums it, as after a dense MLP: no all-to-all, and no rank idles
while another's experts are hot. Vocab-parallel: the embedding and LM head rows, padded so
that every rank holds ceil(vocab / tp) rows; the last shard may be partly padding, and padded
logits are dropped after the all-gather.

Everything here is size arithmetic, plus `TensorParallelGroup`, the two collectives the model
needs. With tp = 1 that group is an identity and never touches torch.distributed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
import torch

from ..errors import ConfigError
from .arch import ModelArch


def _split_counts(arch: ModelArch) -> list[tuple[str, int]]:
    """What tp must divide, named: heads, kv heads, the dense MLP's rows (where a layer has one),
    each expert's rows and the shared expert's (a mixture of experts splits every expert's
    intermediate rows across the ranks, as a dense MLP's)."""
    counts = [("attention heads", arch.num_heads), ("kv heads", arch.num_kv_heads)]
    moe = arch.moe
    if moe is None or moe.num_sparse_layers < arch.num_layers:
        counts.append(("intermediate size", arch.intermediate_size))
    if moe is not None:
        counts.append(("expert intermediate size", moe.intermediate_size))
        if moe.shared_intermediate_size:
            counts.append(("shared expert intermediate size", moe.shared_intermediate_size))
    return counts


def allowed_tp_sizes(arch: ModelArch) -> list[int]:
    """Every tp that splits heads, kv heads and intermediate rows evenly (ascending)."""
    common = math.gcd(*(n for _, n in _split_counts(arch)))
    return [d for d in range(1, common + 1) if common % d == 0]


def check_tensor_parallel(arch: ModelArch, tp_size: int) -> None:
    """Raises ConfigError unless `tp_size` splits the model's heads and MLP evenly."""
    allowed = ", ".join(map(str, allowed_tp_sizes(arch)))
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp must be a positive integer, got {tp_size!r}; allowed tp = {allowed}")
    if tp_size in allowed_tp_sizes(arch):
        return
    heads, kv = arch.num_heads, arch.num_kv_heads
    rows = " and the ".join(f"{name} {n}" for name, n in _split_counts(arch)[2:] if n % tp_size)
    if heads % tp_size or kv % tp_size:
        what = (f"the model has {heads} attention heads and {kv} kv heads; tp must divide both"
                + (f" and the {rows}" if rows else ""))
    else:
        what = f"the model's {rows} {'are' if ' and ' in rows else 'is'} not divisible by tp"
    raise ConfigError(f"tp={tp_size} cannot split this model: {what}: allowed tp = {allowed}")


def vocab_shard_size(vocab_size: int, tp_size: int) -> int:
    """Rows of the embedding / LM head each rank holds (padding included)."""
    return -(-vocab_size // tp_size)


def vocab_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The real vocab rows [start, end) of `tp_rank`; end - start < the shard size where padded."""
    shard = vocab_shard_size(vocab_size, tp_size)
    start = min(tp_rank * shard, vocab_size)
    return start, min(start + shard, vocab_size)


@dataclass(frozen=True)
class ShardSizes:
    """What one tensor-parallel rank holds: local counts and where its slices start."""

    tp_rank: int
    tp_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int        # the full vocabulary (logits are this wide after the gather)
    vocab_shard: int       # embedding / LM head rows on this rank, padding included
    vocab_start: int
    vocab_end: int         # real rows are [vocab_start, vocab_end)
    expert_intermediate_size: int = 0   # each expert's rows on this rank (a mixture of experts)
    shared_intermediate_size: int = 0   # the shared expert's rows on this rank

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def vocab_rows(self) -> int:
        """Real (non-padding) embedding rows on this rank."""
        return self.vocab_end - self.vocab_start

    @property
    def q_start(self) -> int:
        """First row of this rank's q heads in the full q_proj (also its o_proj column)."""
        return self.tp_rank * self.q_size

    @property
    def kv_start(self) -> int:
        return self.tp_rank * self.kv_size

    @property
    def intermediate_start(self) -> int:
        return self.tp_rank * self.intermediate_size

    @property
    def expert_intermediate_start(self) -> int:
        return self.tp_rank * self.expert_intermediate_size

    @property
    def shared_intermediate_start(self) -> int:
        return self.tp_rank * self.shared_intermediate_size


def shard_sizes(arch: ModelArch, tp_rank: int = 0, tp_size: int = 1) -> ShardSizes:
    """Local sizes for one rank; ConfigError if tp does not split the model."""
    check_tensor_parallel(arch, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside 0..{tp_size - 1}")
    start, end = vocab_range(arch.vocab_size, tp_size, tp_rank)
    moe = arch.moe
    return ShardSizes(
        tp_rank=tp_rank, tp_size=tp_size,
        num_heads=arch.num_heads // tp_size, num_kv_heads=arch.num_kv_heads // tp_size,
        head_dim=arch.head_dim, intermediate_size=arch.intermediate_size // tp_size,
        vocab_size=arch.vocab_size, vocab_shard=vocab_shard_size(arch.vocab_size, tp_size),
        vocab_start=start, vocab_end=end,
        expert_intermediate_size=moe.intermediate_size // tp_size if moe else 0,
        shared_intermediate_size=moe.shared_intermediate_size // tp_size if moe else 0)


class TensorParallelGroup:
    """The collectives of one tensor-parallel group, over a torch.distributed process group.

    `TensorParallelGroup()` (no process group) is the single-rank group: both collectives return
    their input and torch.distributed is never imported or initialised. `shm` (a
    runtime.shm_allreduce.ShmAllReduce of this group) takes the all-reduces of CPU float32
    tensors off gloo.
    """

    def __init__(self, group=None, shm=None):
        self.group, self.shm = group, shm
        if group is None:
            self.rank, self.size = 0, 1
        else:
            import torch.distributed as dist

            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums `t` over the ranks, in place (t must be contiguous); returns t."""
        if self.shm is not None and self.shm.accepts(t):
            return self.shm.all_reduce(t)
        if self.group is not None:
            from ..runtime import transport

            transport.all_reduce(t, group=self.group)
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank 0's block first."""
        if self.group is None:
            return t
        from ..runtime import transport

        return torch.cat(transport.all_gather(t.contiguous(), group=self.group), dim=-1)

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.rank}, size={self.size})"

