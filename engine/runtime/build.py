"""Assembles a multi-process Engine: layout checks, KV sizing, worker spawn, one executor per replica.

The controller (this process) never loads weights: it reads the model's config and tokenizer,
converts a GGUF once (so workers only read the cached safetensors), builds the CPU kernels once
(so workers do not race to compile them), then spawns tp x pp x dp workers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..attention import select_backend
from ..build import (GiB, activation_headroom, check_weights_fit, kv_budget, kv_element_bytes,
                     model_source, resolve_device, resolve_dtype, resolve_kv_dtype)
from ..build_paths import moe_kernel_label, use_triton_experts_for
from ..config import EngineConfig
from ..engine import Engine, Replica
from ..errors import ConfigError
from ..kv_groups import (KVGroupLayout, check_group_capacity, groups_for, log_kv_cache,
                         make_block_manager, step_tokens)
from ..kv_swap import attach_swap_space, swap_blocks_for
from ..model.fast_linear import linear_kernel_label
from ..model.int8_linear import LinearQuantization, resolve_quantization
from ..model.lora_adapters import LoraSpec, checked_lora, lora_info
from ..model.sources import model_id_for
from ..structured_output import tokenizer_source
from .executor import PipelineExecutor
from .layout import ParallelLayout, check_gpu_count, ranks_per_device, threads_per_rank
from .pool import WorkerPool, start_fork_server
from . import transport
from .shm_allreduce import group_buffers, resolve_mode
from .worker_extension import WorkerExtension
from .worker import WorkerSpec, worker_main

log = logging.getLogger("batchinfer")


def rank_bytes_per_block(layout: ParallelLayout, arch, rank: int, block_size: int,
                         dtype_bytes: int, groups: Optional[KVGroupLayout] = None) -> int:
    """A block's K/V bytes on `rank`: its stage's layers, or with KV layer groups the page
    slots those layers use."""
    start, end = layout.stage_range(layout.info(rank).stage)
    layers = len(groups.slots_of(start, end)) if groups is not None else end - start
    kv_heads = arch.num_kv_heads // layout.tp
    return 2 * layers * kv_heads * block_size * arch.head_dim * dtype_bytes


def per_rank_kv_budget(config: EngineConfig, layout: ParallelLayout, arch, device,
                       dtype_bytes: int, available: Optional[int] = None,
                       groups: Optional[KVGroupLayout] = None) -> int:
    """KV bytes of one rank: cache.kv_cache_memory, or auto (the host's budget split between the
    ranks on CPU; a GPU's free memory less the rank's share of the weights on CUDA, split between
    the ranks that share the GPU under gpu_transport: host).
    available, groups: as kv_budget's."""
    if config.cache.kv_cache_memory is not None:
        return int(config.cache.kv_cache_memory)
    total = kv_budget(config, arch, device, dtype_bytes, available, groups)
    if device.type == "cpu":
        return total // layout.world_size
    weights = arch.num_params() * dtype_bytes // layout.ranks_per_replica
    # a simulated GPU (available given) is one per rank, whatever this host has
    sharing = (1 if available is not None
               else ranks_per_device(config.parallel, device.type, layout.world_size))
    if sharing == 1:
        return total - weights
    # kv_budget took one forward's working memory off the GPU; each rank on it needs its own
    headroom = activation_headroom(arch, config.scheduler.max_num_batched_tokens,
                                   config.scheduler.max_num_seqs, dtype_bytes)
    budget = (total + headroom) // sharing - headroom - weights
    if budget <= 0:
        raise ConfigError(
            f"parallel.gpu_transport: host puts {sharing} ranks on each GPU, each with "
            f"{weights / GiB:.2f} GiB of weights and {headroom / GiB:.2f} GiB of working memory: "
            f"nothing is left for their KV caches in {(total + headroom) / GiB:.1f} GiB; use "
            "fewer ranks, raise memory.memory_utilization, or give each rank a GPU (nccl)")
    return budget


def num_kv_blocks(config: EngineConfig, layout: ParallelLayout, arch, device, dtype_bytes: int,
                  available: Optional[int] = None,
                  groups: Optional[KVGroupLayout] = None) -> int:
    """Blocks per replica. cache.kv_cache_memory is per rank (as vLLM's is per GPU); auto splits
    the host's budget between all ranks on CPU. Every rank of a replica gets the same count: the
    block tables are shared. available: as kv_budget's."""
    per_rank = per_rank_kv_budget(config, layout, arch, device, dtype_bytes, available, groups)
    block_size, kv_bytes = config.cache.block_size, kv_element_bytes(config, dtype_bytes)
    return min(per_rank // rank_bytes_per_block(layout, arch, r, block_size, kv_bytes, groups)
               for r in layout.replica_ranks(0))


@dataclass
class ModelSetup:
    """What the controller knows of the model before any worker starts."""

    device: torch.device
    dtype: torch.dtype
    dtype_bytes: int
    kv_dtype: torch.dtype             # cache.kv_cache_dtype resolved
    model_dir: Path
    model_id: str
    arch: object
    max_model_len: int
    tokenizer: object
    backend_name: str
    dtype_reason: str = ""            # why this dtype (engine/cpu_dtype.py)
    quantization: Optional[LinearQuantization] = None   # model.quantization resolved
    triton_experts: bool = False      # device.moe_kernel resolved (build_paths.use_triton_experts_for)
    lora: Optional[LoraSpec] = None   # model.lora_modules, checked against the model


def model_setup(config: EngineConfig) -> ModelSetup:
    device = resolve_device(config.device.device)
    source = model_source(config.model)       # config.json, tokenizer, as one process reads them
    arch = source.arch
    dtype_choice = resolve_dtype(config.model.dtype, device, arch)
    dtype = dtype_choice.dtype
    log.info("dtype %s", dtype_choice.reason)
    kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype)
    backend = select_backend(config.device.attention_backend, device, dtype, arch,
                             kv_dtype)  # builds kernels once
    quantization = resolve_quantization(config.model.quantization, config.model.quantize_lm_head,
                                        device, dtype)
    check_weights_fit(config, arch, device, dtype, copies=config.parallel.dp)
    return ModelSetup(device, dtype, dtype.itemsize, kv_dtype, source.model_dir, source.model_id,
                      arch, source.max_model_len, source.tokenizer, backend.name,
                      dtype_choice.reason, quantization,
                      use_triton_experts_for(config.device.moe_kernel, device, arch),
                      checked_lora(config.model, arch))


def check_capacity(num_blocks: int, block_size: int, max_model_len: int,
                   groups: Optional[KVGroupLayout] = None,
                   step: tuple[int, str] = (1, "decoding")) -> None:
    """step: with layer groups, kv_groups.step_tokens (the largest step of one sequence)."""
    if groups is not None:
        check_group_capacity(groups, num_blocks, block_size, max_model_len, step)
    elif num_blocks * block_size < max_model_len:
        raise ConfigError(f"the KV cache holds {num_blocks * block_size} tokens per replica, less "
                          f"than max_model_len ({max_model_len}); raise memory.kv_cache_memory or "
                          "lower model.max_model_len")


def worker_extension(config: EngineConfig) -> WorkerExtension:
    """The plain workers' hooks for a strategy without its own: the stage transport of
    parallel.stage_transport, inputs prepared ahead where the strategy asks for it."""
    ext = WorkerExtension()
    ext.structure_aware = config.parallel.stage_transport == "structured"
    ext.token_safe_inputs = (config.strategy is not None
                             and config.strategy.prepares_inputs_ahead())
    return ext


def rank_extensions(config: EngineConfig, world_size: int, rank_extra: Optional[dict],
                    shared: Optional[WorkerExtension]) -> dict:
    """rank -> WorkerSpec fields, each rank with its extension: the strategy's (one per rank in
    rank_extra, or `shared` for all), else worker_extension(config). parallel.stage_transport
    metadata holds for a strategy's own extension too."""
    out = {r: dict((rank_extra or {}).get(r, {})) for r in range(world_size)}
    for fields in out.values():
        ext = fields.get("extension", shared)
        if ext is None:
            fields["extension"] = worker_extension(config)
        elif config.parallel.stage_transport == "metadata":
            ext.structure_aware = False
    return out


def decode_graph_spec(config: EngineConfig, setup: ModelSetup, layout: ParallelLayout,
                      token_safe: bool, max_num_seqs: int):
    """worker_graphs.WorkerGraphSpec where the workers run their decode steps through two CUDA
    graphs per batch size (token-safe inputs, a rank that holds the whole model, CUDA with the
    Triton attention, device.cuda_graphs not off: worker_graphs.py); None elsewhere."""
    from ..build import use_cuda_graphs
    from .worker_graphs import WorkerGraphSpec

    one_rank = token_safe and setup.device.type == "cuda" and layout.tp == 1 and layout.pp == 1
    if one_rank and config.device.cuda_graphs and setup.backend_name != "triton":
        log.warning("device.cuda_graphs: the workers capture their decode graphs at start, which "
                    "needs the Triton attention; with %s they run eagerly", setup.backend_name)
    if not (one_rank and setup.backend_name == "triton"
            and use_cuda_graphs(config.device.cuda_graphs, setup.backend_name, setup.arch)):
        return None
    return WorkerGraphSpec(max_num_seqs, min(config.device.max_seq_len_to_capture,
                                             setup.max_model_len))


def staged_transport(config: EngineConfig, device_type: str) -> bool:
    """Whether the workers' CUDA tensors travel through host memory (transport.py)."""
    return config.parallel.stages_through_host(device_type)


def replica_swap_blocks(config: EngineConfig, layout: ParallelLayout, setup: ModelSetup) -> int:
    """The swap area's blocks per replica (memory.preemption_mode: swap), each rank holding its
    layers and heads of them. A rank's area takes memory only when the first copy comes, so
    where the replica cannot swap (attach_swap_space says why) it costs nothing."""
    if not config.cache.swap_bytes:
        return 0
    per_block = sum(rank_bytes_per_block(layout, setup.arch, r, config.cache.block_size,
                                         setup.kv_dtype.itemsize)
                    for r in layout.replica_ranks(0))
    return swap_blocks_for(config.cache, per_block)


def start_workers(config: EngineConfig, setup: ModelSetup, layout: ParallelLayout,
                  num_blocks: int, threads: int, rank_extra: Optional[dict] = None,
                  helpers: tuple = (), helper_names: tuple = (), **extra) -> WorkerPool:
    """Spawns one worker per rank of `layout` (extra: further WorkerSpec fields, for every rank;
    rank_extra: rank -> fields for that rank) and the `helpers` processes after them."""
    extension = extra.get("extension")
    if extension is not None:
        host_copy = extension.host_weight_bytes(setup.arch, layout.world_size,
                                                config.model.load_format == "dummy")
        if host_copy[0]:
            check_weights_fit(config, setup.arch, setup.device, setup.dtype,
                              copies=config.parallel.dp, host_copy=host_copy)
    layouts = [layout, *(extension.extra_layouts() if extension is not None else ())]
    rank_extra = rank_extensions(config, layout.world_size, rank_extra, extension)
    tp_buffers = group_buffers(layouts, setup.device.type, config.parallel.tp_all_reduce)
    specs = [WorkerSpec(
        rank=r, layout=layout, model_dir=str(setup.model_dir),
        arch_overrides=config.model.hf_overrides, dummy=config.model.load_format == "dummy",
        seed=config.model.seed, dtype=str(setup.dtype).replace("torch.", ""),
        kv_dtype=str(setup.kv_dtype).replace("torch.", ""), device=setup.device.type,
        max_model_len=setup.max_model_len, num_blocks=num_blocks,
        block_size=config.cache.block_size, threads=threads,
        bind_threads=config.device.bind_threads, attention_backend=setup.backend_name,
        vocab_size=setup.arch.vocab_size, eos_token_ids=tuple(setup.tokenizer.eos_token_ids),
        tokenizer_source=tokenizer_source(setup.tokenizer),
        timeout_s=config.parallel.step_timeout_seconds, tp_buffers=tp_buffers,
        quantization=setup.quantization, triton_experts=setup.triton_experts, lora=setup.lora,
        swap_blocks=replica_swap_blocks(config, layout, setup),
        staged_transport=staged_transport(config, setup.device.type), **extra,
        **rank_extra[r])
        for r in range(layout.world_size)]
    infos = layout.ranks()
    pool = WorkerPool([i.name for i in infos] + list(helper_names), {i.rank: {"replica": i.replica, "stage": i.stage,
                                                         "tp_rank": i.tp_rank} for i in infos})
    pool.plan_deltas = config.parallel.sequence_cache
    log.info("starting %s", layout.describe())
    pool.start(worker_main, specs, config.parallel.startup_timeout_seconds, helpers=helpers)
    return pool


def engine_info(config: EngineConfig, setup: ModelSetup, layout: ParallelLayout, num_blocks: int,
                threads: int, kv_cache_bytes: int,
                kv_groups: Optional[KVGroupLayout] = None) -> dict:
    """What report.json's `engine` says of this engine. kv_groups: the layer groups its block
    managers run with (ParallelPlan.kv_groups)."""
    dummy = config.model.load_format == "dummy"
    arch, block_size = setup.arch, config.cache.block_size
    staged = staged_transport(config, setup.device.type)
    info = {
        "model_id": model_id_for(config.model.path, dummy, config.model.hf_overrides),
        "device": str(setup.device), "dtype": str(setup.dtype).replace("torch.", ""),
        "dtype_reason": setup.dtype_reason, "attention_backend": setup.backend_name,
        "moe_kernel": moe_kernel_label(arch, setup.device, setup.triton_experts),
        "vocab_size": arch.vocab_size,
        "linear_kernel": linear_kernel_label(setup.device, setup.dtype, setup.quantization),
        "quantization": (setup.quantization.describe() if setup.quantization is not None
                         else None),
        "kv_cache_bytes": kv_cache_bytes, "kv_block_size": block_size,
        "kv_cache_dtype": str(setup.kv_dtype).replace("torch.", ""),
        "num_params": arch.num_params(), "flops_per_token": arch.flops_per_token(),
        "max_model_len": setup.max_model_len, "scheduler_policy": config.scheduler.policy,
        "kv_window": config.cache.kv_window(arch), **lora_info(config.model),
        "parallel": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
                     "layers_per_stage": list(layout.layers_per_stage),
                     "threads_per_rank": threads,
                     "tp_all_reduce": resolve_mode(setup.device.type, config.parallel.tp_all_reduce,
                                                   staged),
                     "gpu_transport": transport.describe(setup.device.type, staged),
                     "stage_transport": config.parallel.stage_transport,
                     "sequence_cache": config.parallel.sequence_cache},
    }
    if kv_groups is not None:
        info["kv_window"] = max(kv_groups.windows)
        info["kv_groups"] = kv_groups.describe()
    log_kv_cache(kv_groups, num_blocks, block_size, setup.max_model_len, kv_cache_bytes,
                 info["kv_window"], step_tokens(config, setup.max_model_len), replicas=layout.dp)
    return info


@dataclass
class ParallelPlan:
    """The checked layout of a multi-process engine and what each rank gets."""

    setup: ModelSetup
    layout: ParallelLayout
    num_blocks: int
    threads: int
    kv_groups: Optional[KVGroupLayout] = None   # KV layer groups (kv_groups.py); None: one table


def plan_parallel(config: EngineConfig) -> ParallelPlan:
    start_fork_server()
    setup = model_setup(config)
    layout = ParallelLayout.resolve(config.parallel, setup.arch)
    check_gpu_count(config.parallel, setup.device.type, layout.world_size)
    groups = groups_for(config, setup.arch, setup.max_model_len, layout.stage_ranges())
    num_blocks = num_kv_blocks(config, layout, setup.arch, setup.device, setup.dtype_bytes,
                               groups=groups)
    check_capacity(num_blocks, config.cache.block_size, setup.max_model_len, groups,
                   step_tokens(config, setup.max_model_len))
    threads = threads_per_rank(config.parallel, layout.world_size, config.device.num_threads)
    return ParallelPlan(setup, layout, num_blocks, threads, groups)


def assemble_engine(config: EngineConfig, plan: ParallelPlan, make_executor,
                    scheduler_of=None, extra_info: Optional[dict] = None) -> Engine:
    """One replica per dp rank: a scheduler (`scheduler_of(block_manager)`, default the
    config's) and `make_executor(replica, block_manager)`."""
    setup, layout, block_size = plan.setup, plan.layout, config.cache.block_size
    replicas = []
    for replica in range(layout.dp):
        block_manager = make_block_manager(plan.kv_groups, plan.num_blocks, block_size,
                                           config.cache.enable_prefix_caching,
                                           config.cache.kv_window(setup.arch))
        scheduler = (scheduler_of(block_manager) if scheduler_of is not None else
                     config.make_scheduler(block_manager, setup.max_model_len, layout.pp))
        swap_blocks = attach_swap_space(block_manager, scheduler,
                                        replica_swap_blocks(config, layout, setup))
        replicas.append(Replica(scheduler, make_executor(replica, block_manager)))
    kv_element = setup.kv_dtype.itemsize
    kv_bytes = layout.dp * sum(
        plan.num_blocks * rank_bytes_per_block(layout, setup.arch, r, block_size, kv_element,
                                               plan.kv_groups)
        for r in layout.replica_ranks(0))
    info = engine_info(config, setup, layout, plan.num_blocks, plan.threads, kv_bytes,
                       kv_groups=plan.kv_groups)
    info.update({"preemption_mode": "swap" if swap_blocks else "recompute",
                 "kv_swap_blocks": swap_blocks})
    info.update(extra_info or {})
    return Engine(replicas, setup.tokenizer, setup.max_model_len, info["model_id"], info)


def build_parallel_engine(config: EngineConfig) -> Engine:
    plan = plan_parallel(config)
    pool = start_workers(config, plan.setup, plan.layout, plan.num_blocks, plan.threads,
                         kv_groups=plan.kv_groups)
    return assemble_engine(config, plan, lambda replica, block_manager: PipelineExecutor(
        pool, plan.layout, replica, block_manager, config.parallel.step_timeout_seconds))
