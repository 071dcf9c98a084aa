"""Which path an engine build takes where the config leaves a choice, each decided in one place
for the single-process build, the worker runtime and the simulator: the experts' kernel on
CUDA, async scheduling (steps launched ahead) and CUDA graphs; asked for where it cannot run, a
ConfigError that names why."""
from __future__ import annotations

import logging
from typing import Optional

import torch

from .attention import triton_available
from .config import EngineConfig
from .errors import ConfigError
from .model.arch import ModelArch

log = logging.getLogger("batchinfer")


def use_triton_experts_for(choice: str, device: torch.device, arch: ModelArch) -> bool:
    """device.moe_kernel for this model on this device: the Triton experts (triton_moe.py) for
    a mixture of experts on CUDA unless `torch` is asked for or triton does not import (then the
    per-expert path, with one warning); `triton` asked for off CUDA is a ConfigError."""
    if choice == "triton" and device.type != "cuda":
        raise ConfigError("device.moe_kernel: triton runs on CUDA; on the CPU the experts take "
                          "the CPU's kernels (leave it auto)")
    if arch.moe is None or device.type != "cuda" or choice == "torch":
        return False
    missing = triton_available()
    if missing:
        if choice == "triton":
            raise ConfigError(f"device.moe_kernel: triton cannot run here ({missing})")
        log.warning("the Triton experts can't run (%s): each expert runs its own GEMMs", missing)
        return False
    return True


def moe_kernel_label(arch: ModelArch, device: torch.device, triton_experts: bool
                     ) -> Optional[str]:
    """What computes the experts (engine.info's moe_kernel): None for a dense model."""
    if arch.moe is None:
        return None
    return "triton" if triton_experts else "torch" if device.type == "cuda" else "cpu"


def use_async_scheduling(config: EngineConfig, device: torch.device,
                         arch: Optional[ModelArch] = None,
                         triton_experts: Optional[bool] = None) -> bool:
    """scheduler.async_scheduling (the strategy's own key first, where its recipe keys take
    it): empty means on with CUDA; asked for where it can't run, a ConfigError that names why.
    `triton_experts`: use_triton_experts_for's answer where the caller has it (None: asked
    here)."""
    strategy = config.strategy
    if strategy is not None and "async_scheduling" in getattr(type(strategy), "model_fields", {}):
        # a strategy whose recipe keys take it (those with the baseline's batching knobs)
        choice, key = strategy.scheduler_config().async_scheduling, "strategy.async_scheduling"
    else:
        choice, key = config.scheduler.async_scheduling, "scheduler.async_scheduling"
    why_not = ""
    if config.parallel.multiprocess:
        why_not = "the layout runs on worker processes"
    elif strategy is not None and strategy.name != "baseline":
        why_not = f"strategy {strategy.name} schedules its own steps"
    elif config.cache.enable_prefix_caching:
        why_not = "prefix caching indexes blocks by token values the host reads a step late"
    elif (arch is not None and arch.moe is not None and device.type == "cuda"
          and not (use_triton_experts_for(config.device.moe_kernel, device, arch)
                   if triton_experts is None else triton_experts)):
        why_not = ("the model is a mixture of experts whose experts run one by one "
                   "(device.moe_kernel: torch), each layer reading their token counts on the "
                   "host: the next step could not launch ahead")
    if choice and why_not:
        raise ConfigError(f"{key}: true needs one process, the baseline strategy and no prefix "
                          f"caching; here {why_not}")
    return bool(choice) if choice is not None else device.type == "cuda" and not why_not


def use_cuda_graphs(choice: Optional[bool], backend_name: str,
                   arch: Optional[ModelArch] = None) -> bool:
    """device.cuda_graphs: empty means on with the Triton attention (its kernel reads no padding,
    so a graph's padded block tables cost nothing); with the torch path they are opt-in. Off
    for a mixture of experts: the per-expert path reads each expert's token count on the host,
    which a graph cannot replay, and the Triton experts' steps (triton_moe.py, no host read)
    keep their expert load in tensors a replay would not update; they run eagerly."""
    if arch is not None and arch.moe is not None:
        if choice:
            raise ConfigError("device.cuda_graphs: true cannot run a mixture-of-experts model: "
                              "the per-expert path reads the experts' token counts on the host "
                              "and the Triton experts' load counts are not kept in a graph; "
                              "leave it empty (off for this model)")
        return False
    return choice if choice is not None else backend_name == "triton"
