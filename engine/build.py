"""Assembles an Engine from an EngineConfig: device, weights, KV budget, scheduler, executor."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .attention import fused_ops_for, select_backend
from .config import EngineConfig, ModelConfig
from .cpu_binding import bind_compute_threads, compute_threads, warn_if_oversubscribed
from .cpu_dtype import DtypeChoice, resolve_cpu_dtype
from .cuda_graphs import DecodeGraphs
from .build_paths import (moe_kernel_label, use_async_scheduling, use_cuda_graphs,
                          use_triton_experts_for)
from .device import resolve_device  # noqa: F401 - imported from here by callers
from .engine import Engine, Replica
from .errors import ConfigError
from .executor import InProcessExecutor
from .kv_cache import KVCacheSpec, allocate_kv_tensors
from .kv_swap import SwapArea, attach_swap_space, swap_area_used, swap_blocks_for
from .kv_groups import (check_group_capacity, groups_for, log_kv_cache, make_block_manager,
                        step_tokens)
from .model.arch import ModelArch
from .model.fast_linear import linear_kernel_label
from .model.fused_experts import use_triton_experts
from .model.int8_linear import resolve_quantization
from .model.loader import build_model, load_arch
from .model.lora_adapters import checked_lora, lora_info
from .model.sources import model_id_for, resolve_model_dir
from .sampler import Sampler
from .structured_output import tokenizer_source
from .tokenizer import Tokenizer, load_tokenizer, warn_if_past_vocabulary

log = logging.getLogger("batchinfer")
CPU_AUTO_KV_CAP = 4 * 2**30  # like vLLM's CPU default: a host shares its RAM with other jobs
GiB = 2**30


def resolve_dtype(choice: str, device: torch.device, arch: ModelArch) -> DtypeChoice:
    """model.dtype -> the dtype and why: on CUDA auto is bf16; on CPU the host decides
    (engine/cpu_dtype.py: bf16 where the CPU has native bf16 and it measures faster)."""
    if device.type == "cpu":
        return resolve_cpu_dtype(choice, arch.hidden_size, arch.intermediate_size)
    if choice == "auto":
        return DtypeChoice(torch.bfloat16, "bfloat16: the default on CUDA")
    return DtypeChoice(DTYPES[choice], f"{choice}: asked for")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NARROW_KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}  # cache.kv_cache_dtype


def resolve_kv_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype:
    """cache.kv_cache_dtype: auto stores K/V in the model's dtype."""
    return model_dtype if choice == "auto" else NARROW_KV_DTYPES[choice]


def kv_element_bytes(config: EngineConfig, model_dtype_bytes: int) -> int:
    """Bytes of one cached K or V element under cache.kv_cache_dtype (for callers that know the
    model's element size but not its dtype: the simulator, the layouts' sizing)."""
    choice = config.cache.kv_cache_dtype
    return model_dtype_bytes if choice == "auto" else NARROW_KV_DTYPES[choice].itemsize


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB


def check_weights_fit(config: EngineConfig, arch: ModelArch, device: torch.device,
                      dtype: torch.dtype, copies: int = 1,
                      host_copy: tuple[int, str] = (0, "")) -> None:
    """A ConfigError before loading when the weights (`copies` of them: one per data-parallel
    replica) and an explicit memory.kv_cache_memory cannot fit the host's available memory: the
    load would end in an allocator error or the OOM killer, mid-setup. CPU only (a GPU's memory
    is sized by gpu_memory.py), except `host_copy`: (bytes, what keeps them) of weights held in
    host memory beside the model's (a worker extension's host copy), counted on any device."""
    extra, what = host_copy
    on_host = device.type == "cpu"
    if not on_host and not extra:
        return
    weights = arch.num_params() * dtype.itemsize * max(copies, 1) if on_host else 0
    asked = config.cache.kv_cache_memory if on_host else None
    need = weights + (int(asked) if asked is not None else 0) + extra
    available = available_memory(torch.device("cpu"))
    if need <= available:
        return
    held = f" + {what} {extra / GiB:.1f} GiB" if extra else ""
    if not on_host:
        raise ConfigError(
            f"{what} takes {extra / GiB:.1f} GiB of host memory, more than the "
            f"{available / GiB:.1f} GiB this host has available; use fewer layers "
            "(model.hf_overrides: num_hidden_layers) or a host with more memory")
    name = str(dtype).replace("torch.", "")
    kv = f" + memory.kv_cache_memory {int(asked) / GiB:.1f} GiB" if asked is not None else ""
    replicas = f" x {copies} replicas (parallel.dp)" if copies > 1 else ""
    lighter = " model.dtype: bfloat16 (half the bytes)," if dtype.itemsize > 2 else ""
    raise ConfigError(
        f"the model's weights take {weights / GiB:.1f} GiB ({arch.num_params() / 1e9:.2f} B "
        f"parameters in {name}{replicas}){kv}{held}, more than the {available / GiB:.1f} GiB "
        f"this host has available; use{lighter} fewer layers (model.hf_overrides: "
        f"num_hidden_layers),{' fewer replicas,' if copies > 1 else ''} or a GPU")


def activation_headroom(arch: ModelArch, max_tokens: int, max_seqs: int, dtype_bytes: int) -> int:
    """Working memory of one forward: hidden/qkv/MLP activations for the token budget, logits."""
    per_token = 4 * arch.hidden_size + arch.q_size + 2 * arch.kv_size + arch.ffn_activation_width()
    return (max_tokens * per_token * dtype_bytes + 4 * max_seqs * arch.vocab_size * 4 + GiB // 2)


def kv_budget(config: EngineConfig, arch: ModelArch, device: torch.device, dtype_bytes: int,
              available: Optional[int] = None, groups=None) -> int:
    """available: the device's free bytes (default: asked of the device; the simulator passes
    a profiled or a preset GPU's memory). groups: the KV layer groups the model runs with (no
    swap area with them)."""
    if config.cache.kv_cache_memory is not None:
        return int(config.cache.kv_cache_memory)
    if available is None:
        available = available_memory(device)
    # every replica's swap area is host memory the KV cache cannot have on a CPU
    swap = device.type == "cpu" and swap_area_used(config, arch, groups)
    free = available * config.cache.memory_utilization - (
        config.cache.swap_bytes * config.parallel.dp if swap else 0)
    budget = int(free - activation_headroom(arch, config.scheduler.max_num_batched_tokens,
                                            config.scheduler.max_num_seqs, dtype_bytes))
    if device.type == "cpu":
        budget = min(budget, CPU_AUTO_KV_CAP)
    if budget <= 0:
        raise ConfigError(f"no memory left for the KV cache after the weights "
                          f"({available / GiB:.1f} GiB available); set "
                          "memory.kv_cache_memory or use a smaller model")
    return budget


def check_strategy_applies_lora(config: EngineConfig) -> None:
    """model.lora_modules under a strategy whose workers build model partitions of their own
    (StrategyParams.applies_lora false): refused by name before any layout search or worker
    start, not by a worker's failure minutes later."""
    if config.model.lora_modules and not getattr(config.strategy, "applies_lora", True):
        raise ConfigError(config.strategy.lora_refusal(config.model, None))


def preflight(config: EngineConfig, arch: ModelArch, max_model_len: Optional[int] = None) -> None:
    """What the engine build refuses that the model's config alone decides, run without loading
    weights (`batchinfer validate`, `run --dry-run`): the parallel layout against the model's
    heads and layers, the attention backend and quantization against the device and dtype, the
    strategy's own refusals (StrategyParams.check_config), and an explicit
    memory.kv_cache_memory that cannot hold one max_model_len sequence. Weights and KV this host
    could not hold are a warning: the job may run on another host (a Slurm node)."""
    from .attention import check_backend_choice
    from .model.int8_linear import check_quantization_setting
    from .runtime.layout import ParallelLayout, check_gpu_count

    device = resolve_device(config.device.device)   # cuda asked for where torch sees none
    dtype = None if config.model.dtype == "auto" else getattr(torch, config.model.dtype)
    if not getattr(config.strategy, "external_engine", False):   # another engine's settings
        check_backend_choice(config.device.attention_backend, device.type, dtype)
        check_quantization_setting(config.model.quantization, device.type, dtype)
        checked_lora(config.model, arch)         # the adapters' files against the model
    check_strategy_applies_lora(config)
    layout = ParallelLayout.resolve(config.parallel, arch)
    check_gpu_count(config.parallel, device.type, layout.world_size)
    if config.strategy is not None:
        config.strategy.check_config(config, arch)
    if not getattr(config.strategy, "external_engine", False):
        use_async_scheduling(config, device, arch)     # asked for where it cannot run
    if max_model_len is not None:
        _check_explicit_kv(config, arch, max_model_len)
    try:
        check_weights_fit(config, arch, device, dtype or (
            torch.bfloat16 if 2 in _possible_kv_elements(config) else torch.float32),
            copies=config.parallel.dp)
    except ConfigError as exc:
        log.warning("on this host: %s (a run here would be refused)", exc)


def _check_explicit_kv(config: EngineConfig, arch: ModelArch, max_model_len: int) -> None:
    """The build's refusal of a cache smaller than one sequence, made before any weight loads,
    with the build's own sizing (one process, the workers' per-rank blocks, KV layer groups, or
    the strategy's: StrategyParams.check_kv_budget), for each element size the recipe may run
    with (dtype auto may take bf16 or fp32 by the host): refused only where every one is
    (blocks are whole, so a smaller element is not always the more lenient). Only an explicit
    memory.kv_cache_memory: an automatic one depends on the memory of the host that runs the
    job; another engine (`external_engine`) sizes its own."""
    strategy = config.strategy
    if config.cache.kv_cache_memory is None or getattr(strategy, "external_engine", False):
        return
    refusal = None
    for element in _possible_kv_elements(config):
        try:
            _check_kv_in(config, arch, max_model_len, element)
            return
        except ConfigError as exc:
            refusal = refusal or exc
    raise refusal


def _check_kv_in(config: EngineConfig, arch: ModelArch, max_model_len: int,
                 element: int) -> None:
    """_check_explicit_kv for one element size."""
    strategy = config.strategy
    if strategy is not None and strategy.check_kv_budget(config, arch, max_model_len, element):
        return
    step = step_tokens(config, max_model_len)
    if config.parallel.multiprocess:
        from .runtime.build import check_capacity, num_kv_blocks
        from .runtime.layout import ParallelLayout

        layout = ParallelLayout.resolve(config.parallel, arch)
        groups = groups_for(config, arch, max_model_len, layout.stage_ranges())
        check_capacity(num_kv_blocks(config, layout, arch, torch.device("cpu"), element,
                                     groups=groups),
                       config.cache.block_size, max_model_len, groups, step)
        return
    one_process_cache_spec(config, arch, int(config.cache.kv_cache_memory),
                           groups_for(config, arch, max_model_len), element, max_model_len, step)


def one_process_cache_spec(config: EngineConfig, arch: ModelArch, budget: int, groups,
                           kv_bytes: int, max_model_len: int,
                           step: tuple[int, str]) -> KVCacheSpec:
    """The one-process engine's cache in `budget` bytes (with KV layer groups a block is one page
    of page_layers layers: kv_groups.py), refused where one max_model_len sequence cannot run."""
    spec = KVCacheSpec.from_budget(budget, groups.page_layers if groups else arch.num_layers,
                                   config.cache.block_size, arch.num_kv_heads, arch.head_dim,
                                   kv_bytes)
    if groups is None and spec.capacity_tokens < max_model_len:
        raise ConfigError(
            f"the KV cache holds {spec.capacity_tokens} tokens, less than max_model_len "
            f"({max_model_len}); raise memory.kv_cache_memory (one token takes "
            f"{arch.kv_bytes_per_token(kv_bytes)} bytes) or lower model.max_model_len")
    check_group_capacity(groups, spec.num_blocks, spec.block_size, max_model_len, step)
    return spec


def _possible_kv_elements(config: EngineConfig) -> tuple[int, ...]:
    """The bytes of a cached element the recipe may run with: 2 for a 16-bit kv_cache_dtype or
    model dtype (and auto on CUDA), 4 for float32; auto on a CPU either where it has native
    bf16 (or its flags are unknown: `dtype: auto` measures), else 4."""
    if config.cache.kv_cache_dtype != "auto" or config.model.dtype in ("bfloat16", "float16"):
        return (2,)
    if config.model.dtype == "float32":
        return (4,)
    if config.device.device == "cuda" or (config.device.device == "auto"
                                          and torch.cuda.is_available()):
        return (2,)
    from .cpu_dtype import NATIVE_BF16_FLAGS
    from .host_cpu import cpu_identity

    flags = cpu_identity()[1]
    return (2, 4) if not flags or any(flag in flags for flag in NATIVE_BF16_FLAGS) else (4,)


def build_engine(config: EngineConfig) -> Engine:
    for note in config.strategy.notes(config.parallel) if config.strategy is not None else ():
        log.warning("%s", note)
    check_strategy_applies_lora(config)
    own = config.strategy.build_engine(config) if config.strategy is not None else None
    if own is not None:
        engine = own
        if config.model.lora_modules and "lora_modules" not in engine.info:   # its own model
            engine.close()
            raise ConfigError(f"model.lora_modules: strategy {config.strategy.name} builds its "
                              "own model, which does not apply LoRA adapters")
    elif config.parallel.multiprocess:
        from .runtime.build import build_parallel_engine

        use_async_scheduling(config, torch.device("cpu"))    # asked for here: a ConfigError

        engine = build_parallel_engine(config)
    else:
        engine = _build_single_process(config)
    if config.strategy is not None:
        engine.info["strategy"] = config.strategy.name
        try:
            config.strategy.prepare(engine)
        except BaseException:
            engine.close()
            raise
    return engine


@dataclass
class ModelSource:
    """A model before any weight is loaded: its directory, config, context length, tokenizer."""

    model_dir: Path
    model_id: str
    arch: ModelArch
    max_model_len: int
    tokenizer: Tokenizer


def model_source(model_cfg: ModelConfig) -> ModelSource:
    model_dir, model_id = resolve_model_dir(model_cfg.path)
    arch = load_arch(Path(model_dir), model_cfg.hf_overrides or None)
    tokenizer = load_tokenizer(model_cfg, Path(model_dir), model_id, arch.eos_token_ids)
    warn_if_past_vocabulary(tokenizer, arch.vocab_size, model_cfg)
    return ModelSource(Path(model_dir), model_id, arch,
                       _max_model_len(model_cfg.max_model_len, arch), tokenizer)


def _build_single_process(config: EngineConfig) -> Engine:
    device = resolve_device(config.device.device)
    source = model_source(config.model)
    model_dir, arch = source.model_dir, source.arch
    # bad asks fail before loading
    triton_experts = use_triton_experts_for(config.device.moe_kernel, device, arch)
    launch_ahead = use_async_scheduling(config, device, arch, triton_experts)
    if device.type == "cpu":
        warn_if_oversubscribed(config.device.num_threads)
        bind_compute_threads(config.device.bind_threads,
                             compute_threads(config.device.num_threads))
    max_model_len, tokenizer = source.max_model_len, source.tokenizer
    dtype_choice = resolve_dtype(config.model.dtype, device, arch)
    dtype = dtype_choice.dtype
    log.info("dtype %s", dtype_choice.reason)
    dtype_bytes = dtype.itemsize
    kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype)
    kv_bytes = kv_dtype.itemsize

    quantization = resolve_quantization(config.model.quantization, config.model.quantize_lm_head,
                                        device, dtype)
    check_weights_fit(config, arch, device, dtype)
    dummy = config.model.load_format == "dummy"
    model = build_model(Path(model_dir), arch, dtype, device, max_model_len, dummy=dummy,
                        seed=config.model.seed, quantization=quantization,
                        lora=checked_lora(config.model, arch))
    backend = select_backend(config.device.attention_backend, device, dtype, arch, kv_dtype)
    fused_ops = fused_ops_for(backend.name)
    if fused_ops is not None:
        model.use_ops(fused_ops)
    if triton_experts:
        use_triton_experts(model)
    groups = groups_for(config, arch, max_model_len)
    step = step_tokens(config, max_model_len)
    if device.type == "cuda":
        budget = _gpu_kv_budget(config, model, backend, arch, max_model_len, kv_dtype, device,
                                groups, step)
    else:
        budget = kv_budget(config, arch, device, dtype_bytes, groups=groups)
    spec = one_process_cache_spec(config, arch, budget, groups, kv_bytes, max_model_len, step)
    block_manager = make_block_manager(groups, spec.num_blocks, spec.block_size,
                                       config.cache.enable_prefix_caching,
                                       config.cache.kv_window(arch))
    kv_caches = allocate_kv_tensors(spec, kv_dtype, device)
    if groups is not None:
        kv_caches = groups.layer_caches(kv_caches, 0, arch.num_layers)
        model.use_kv_groups(groups)
    sched_cfg = config.scheduler
    scheduler = config.make_scheduler(block_manager, max_model_len)
    sampler = Sampler(arch.vocab_size, tokenizer.eos_token_ids, device, seed=config.model.seed,
                      native_kernels=backend.name == "native",
                      tokenizer_source=tokenizer_source(tokenizer))
    graphs = None
    if device.type == "cuda" and use_cuda_graphs(config.device.cuda_graphs, backend.name, arch):
        graphs = DecodeGraphs(model, kv_caches, block_manager, device, sched_cfg.max_num_seqs,
                              min(config.device.max_seq_len_to_capture, max_model_len),
                              triton_attention=backend.name == "triton")
        graphs.capture_all()
    executor_class = InProcessExecutor
    if launch_ahead:
        from .steps_ahead import AsyncInProcessExecutor as executor_class
    executor = executor_class(model, kv_caches, backend, sampler, block_manager, device, graphs)
    swap_blocks = attach_swap_space(block_manager, scheduler,
                                    swap_blocks_for(config.cache, spec.bytes_per_block))
    executor.swap_area = SwapArea(swap_blocks)
    info = {
        "model_id": model_id_for(config.model.path, dummy, config.model.hf_overrides),
        "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "dtype_reason": dtype_choice.reason,
        "attention_backend": backend.name, "vocab_size": arch.vocab_size,
        "kv_cache_bytes": spec.num_blocks * spec.bytes_per_block,
        "kv_cache_dtype": str(kv_dtype).replace("torch.", ""),
        "kv_block_size": spec.block_size, "num_params": arch.num_params(),
        "flops_per_token": arch.flops_per_token(), "max_model_len": max_model_len,
        "scheduler_policy": sched_cfg.policy,
        "linear_kernel": linear_kernel_label(device, dtype, quantization),
        "quantization": quantization.describe() if quantization is not None else None,
        "cuda_graphs": graphs is not None, "async_scheduling": launch_ahead,
        "num_threads": torch.get_num_threads() if device.type == "cpu" else None,
        "moe_kernel": moe_kernel_label(arch, device, triton_experts),
        "kv_window": block_manager.window,
        "preemption_mode": "swap" if swap_blocks else "recompute",
        "kv_swap_blocks": swap_blocks, **lora_info(config.model),
        **({"kv_groups": groups.describe()} if groups is not None else {}),
    }
    log_kv_cache(groups, spec.num_blocks, spec.block_size, max_model_len, info["kv_cache_bytes"],
                 block_manager.window, step)
    return Engine([Replica(scheduler, executor)], tokenizer, max_model_len, info["model_id"], info)


def _gpu_kv_budget(config: EngineConfig, model, backend, arch: ModelArch, max_model_len: int,
                   kv_dtype: torch.dtype, device: torch.device, groups=None,
                   step: tuple[int, str] = (1, "decoding")) -> int:
    """As vLLM sizes it (gpu_memory.py): the card's memory x memory_utilization, less the weights,
    a profiled step's peak and memory held elsewhere; refused with the numbers when max_model_len
    tokens of KV don't fit."""
    from .gpu_memory import kv_budget_on_gpu, measure

    block = config.cache.block_size
    memory = measure(model, backend, arch, config.scheduler.max_num_batched_tokens,
                     config.scheduler.max_num_seqs, max_model_len, block, kv_dtype, device)
    asked = config.cache.kv_cache_memory
    needed = -(-max_model_len // block) * block * arch.kv_bytes_per_token(kv_dtype.itemsize)
    what = f"max_model_len {max_model_len} tokens"
    if groups is not None:    # KV layer groups: a request's blocks over its groups, a page each,
        # while its largest step (kv_groups.step_tokens) grows every group
        layer_block = block * arch.kv_bytes_per_token(kv_dtype.itemsize) // arch.num_layers
        needed = (groups.blocks_per_sequence(max_model_len, block, step[0]) * groups.page_layers
                  * layer_block)
        what = (f"{groups.blocks_per_sequence(max_model_len, block, step[0])} blocks of a "
                f"{max_model_len}-token request computing {step[0]} tokens a step ({step[1]})")
    return kv_budget_on_gpu(memory, config.cache.memory_utilization,
                            None if asked is None else int(asked), needed, what)


def _max_model_len(requested: Optional[int], arch: ModelArch) -> int:
    limit = arch.context_limit()
    if requested is None:
        return limit
    if requested > limit:
        clipped = limit < arch.max_position_embeddings
        raise ConfigError(f"model.max_model_len {requested} exceeds what the model supports "
                          f"({limit}: {'sliding_window' if clipped else 'max_position_embeddings'})")
    return requested
