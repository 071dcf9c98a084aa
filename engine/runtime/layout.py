"""Who is who in a multi-process run: ranks, pipeline stages, tensor shards, replicas.

Global rank = replica * (pp * tp) + stage * tp + tp_rank. Each rank holds one `ModelPartition`
(a layer range and a TP shard). Every check here runs in the controller before any process
starts, so an impossible layout is a clear error, not a hang.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import ParallelConfig
from ..cpu_binding import compute_threads
from ..errors import ConfigError
from ..model.arch import ModelArch
from ..model.causal_lm import ModelPartition


@dataclass(frozen=True)
class RankInfo:
    rank: int
    replica: int
    stage: int
    tp_rank: int
    partition: ModelPartition

    @property
    def name(self) -> str:
        return f"rank {self.rank} (replica {self.replica}, stage {self.stage}, tp {self.tp_rank})"


def even_layer_split(num_layers: int, pp: int) -> list[int]:
    """Layers per stage, as even as possible; earlier stages take the remainder last (the last
    stage also runs the LM head, so it gets no extra layer when the split is uneven)."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if stage < extra else 0) for stage in range(pp)]


# What a decoder layer costs per generated token beside its GEMMs. Defaults: ShareGPT's mean
# lengths (107-token prompts, 296-token replies) and this class of CPU (165 GFLOP/s, 23 GB/s).
PROMPT_TOKENS_PER_OUTPUT = 107 / 296
MEAN_CONTEXT_TOKENS = 107 + 296 / 2
FLOPS_PER_BYTE = 165 / 23


def compute_balanced_split(arch: ModelArch, pp: int,
                           prompt_per_output: float = PROMPT_TOKENS_PER_OUTPUT,
                           mean_context: float = MEAN_CONTEXT_TOKENS,
                           flops_per_byte: float = FLOPS_PER_BYTE) -> list[int]:
    """Layers per stage so that each stage does about the same work per generated token.

    The last stage also runs the LM head, once per generated token, while a decoder layer also
    runs on the prompt tokens (1 + prompt/output tokens per generated token) and reads the KV
    cache at the mean context (memory-bound: its bytes are charged at the machine's FLOP/byte
    balance). On SmolLM2 with ShareGPT-like lengths the head then weighs about 4 layers and pp=2
    splits 17 + 13 (benchmarks/strategies/parallel_layouts.py: stage bubbles 10% / 12%, against 4% / 24% for
    19 + 11, which counts GEMM FLOPs alone)."""
    layers = arch.num_layers
    if pp == 1:
        return [layers]
    head = 2 * arch.vocab_size * arch.hidden_size
    gemm_per_layer = (arch.flops_per_token() - head) / layers
    kv_bytes = 2 * arch.kv_size * 4 * mean_context
    per_layer = (gemm_per_layer + kv_bytes * flops_per_byte) * (1 + prompt_per_output)
    target = (layers * per_layer + head) / pp
    last = int(round((target - head) / per_layer))
    last = min(max(1, last), layers - (pp - 1))
    return even_layer_split(layers - last, pp - 1) + [last]


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    dp: int
    layers_per_stage: tuple[int, ...]

    @classmethod
    def resolve(cls, config: ParallelConfig, arch: ModelArch) -> "ParallelLayout":
        tp, pp, dp = config.tp, config.pp, config.dp
        layers = arch.num_layers
        if pp > layers:
            raise ConfigError(f"parallel.pp: pp={pp} pipeline stages, but the model has only "
                              f"{layers} layers; allowed: 1..{layers}")
        if config.pp_layers is not None:
            split = list(config.pp_layers)
            if len(split) != pp or sum(split) != layers or min(split) < 1:
                raise ConfigError(f"parallel.pp_layers: {split} must list {pp} positive layer "
                                  f"counts (one per stage) summing to the model's {layers} layers")
        elif config.pp_balance == "compute":
            split = compute_balanced_split(arch, pp)
        else:
            split = even_layer_split(layers, pp)
        if tp > 1:
            from ..model.shard import check_tensor_parallel

            try:
                check_tensor_parallel(arch, tp)
            except ConfigError as exc:
                raise ConfigError(f"parallel.tp: {exc}") from None
        return cls(tp, pp, dp, tuple(split))

    @property
    def ranks_per_replica(self) -> int:
        return self.tp * self.pp

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def stage_range(self, stage: int) -> tuple[int, int]:
        start = sum(self.layers_per_stage[:stage])
        return start, start + self.layers_per_stage[stage]

    def stage_ranges(self) -> list[tuple[int, int]]:
        """Every pipeline stage's layer range, in stage order."""
        return [self.stage_range(stage) for stage in range(self.pp)]

    def rank(self, replica: int, stage: int, tp_rank: int) -> int:
        return replica * self.ranks_per_replica + stage * self.tp + tp_rank

    def info(self, rank: int) -> RankInfo:
        replica, within = divmod(rank, self.ranks_per_replica)
        stage, tp_rank = divmod(within, self.tp)
        start, end = self.stage_range(stage)
        partition = ModelPartition(start, end, tp_rank=tp_rank, tp_size=self.tp)
        return RankInfo(rank, replica, stage, tp_rank, partition)

    def ranks(self) -> list[RankInfo]:
        return [self.info(r) for r in range(self.world_size)]

    def replica_ranks(self, replica: int) -> list[int]:
        first = replica * self.ranks_per_replica
        return list(range(first, first + self.ranks_per_replica))

    def tp_groups(self) -> list[list[int]]:
        """The ranks that all-reduce together: one group per (replica, stage)."""
        return [[self.rank(r, s, t) for t in range(self.tp)]
                for r in range(self.dp) for s in range(self.pp)]

    def next_rank(self, rank: int) -> Optional[int]:
        info = self.info(rank)
        return None if info.stage == self.pp - 1 else self.rank(info.replica, info.stage + 1, info.tp_rank)

    def prev_rank(self, rank: int) -> Optional[int]:
        info = self.info(rank)
        return None if info.stage == 0 else self.rank(info.replica, info.stage - 1, info.tp_rank)

    def sampling_rank(self, replica: int) -> int:
        """Where tokens are sampled by default: the last stage's first TP rank."""
        return self.rank(replica, self.pp - 1, 0)

    def describe(self) -> str:
        stages = ", ".join(f"{a}-{b - 1}" for a, b in map(self.stage_range, range(self.pp)))
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} ({self.world_size} worker processes; "
                f"layers per stage: {stages})")


def threads_per_rank(config: ParallelConfig, world_size: int, num_threads: Optional[int]) -> int:
    """Cores split between ranks (at least one each) unless the recipe says otherwise."""
    if config.threads_per_rank:
        return config.threads_per_rank
    cores = compute_threads(num_threads)
    return max(1, cores // world_size)


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpu_count(config: ParallelConfig, device_type: str, world_size: int,
                    visible: Optional[int] = None) -> None:
    """NCCL runs one rank per GPU: a CUDA layout of more ranks than visible GPUs is refused
    before anything loads, unless `gpu_transport: host` lets ranks share them."""
    if device_type != "cuda" or world_size < 2 or config.stages_through_host(device_type):
        return
    visible = visible_gpus() if visible is None else visible
    if visible < world_size:
        raise ConfigError(
            f"parallel: tp={config.tp} x pp={config.pp} x dp={config.dp} is {world_size} ranks, "
            f"one GPU each over NCCL, and torch sees {visible} GPU{'s' if visible != 1 else ''}; "
            "lower tp / pp / dp, or set parallel.gpu_transport: host to run several ranks on a "
            "GPU (through host memory: slower)")


def ranks_per_device(config: ParallelConfig, device_type: str, world_size: int,
                     visible: Optional[int] = None) -> int:
    """How many ranks share each GPU (rank r runs on GPU r mod visible): 1 but under
    gpu_transport: host with fewer GPUs than ranks. 1 on CPU (there the host's memory is split
    between all ranks)."""
    if not config.stages_through_host(device_type):
        return 1
    visible = visible_gpus() if visible is None else visible
    return -(-world_size // max(visible, 1))
