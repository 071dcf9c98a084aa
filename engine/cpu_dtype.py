"""Which number format a CPU model computes in: `model.dtype: auto` decides by the host.

On CPU, bf16 here means bf16 *weights* for the linear layers (half the bytes to store and to
stream) with every activation, norm, rotary, attention and sampling step in fp32; the KV cache
follows the model's dtype (bf16) unless `cache.kv_cache_dtype` says otherwise. How the linears
run is engine/model/fast_linear.py's `bf16_linear_kernel`: on CPUs with native bf16 arithmetic
the input is rounded to bf16 for the multiply and the products summed in fp32 (the project's
AMX tile kernel where AMX-BF16 is usable, its vdpbf16ps kernel on AVX512-BF16 without AMX);
elsewhere the blocked kernel widens bf16 panels to fp32.

`auto` takes bf16 only where the CPU has native bf16 *and* a short check, the model's own decode
GEMMs timed both ways, measures it faster; the check's result is kept in the kernel cache (per
CPU, torch version, thread count, shapes and kernel build), so it runs once per machine and again
after the kernels' sources change. Everywhere else
`auto` is fp32: on AVX2-only CPUs bf16 arithmetic is emulated (~300x slower). An explicit
`bfloat16` always runs (weights rounded to bf16, correct); on a CPU without native bf16 the log
warns once with the measured speed against fp32.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from . import envs
from .host_cpu import cpu_identity

log = logging.getLogger("batchinfer")
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
AUTO_MIN_SPEEDUP = 1.1      # auto takes bf16 when its GEMMs measured at least this much faster
CHECK_ROWS = 128            # a decode step's rows: the shape an offline batch job spends its time in
CHECK_ROUNDS = 9
CHECK_FILE = "check.json"


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str             # for the log and report.json's engine.dtype_reason


def activation_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """What a model in `dtype` on `device` computes its activations in: fp32 for bf16 on CPU
    (only the linears' weights are bf16), the model's dtype everywhere else."""
    return torch.float32 if device.type == "cpu" and dtype == torch.bfloat16 else dtype


@lru_cache(maxsize=None)
def native_bf16_flags() -> tuple[str, ...]:
    """The flags of native bf16 arithmetic this CPU has (amx_bf16, avx512_bf16), in that order."""
    _, flags = cpu_identity()
    if not flags:       # no /proc/cpuinfo: torch's own cpuinfo
        found = []
        if torch.cpu._is_amx_tile_supported():
            found.append("amx_bf16")
        if torch.cpu._is_avx512_bf16_supported():
            found.append("avx512_bf16")
        return tuple(found)
    return tuple(f for f in NATIVE_BF16_FLAGS if f in flags)


def resolve_cpu_dtype(choice: str, hidden: int, intermediate: int) -> DtypeChoice:
    """model.dtype on CPU -> the dtype and why. float16 keeps torch's plain path (no fp16 kernels)."""
    native = native_bf16_flags()
    if choice == "float32":
        return DtypeChoice(torch.float32, "float32: asked for")
    if choice == "float16":
        return DtypeChoice(torch.float16, "float16: asked for (torch's portable path)")
    if choice == "bfloat16":
        if native:
            return DtypeChoice(torch.bfloat16, f"bfloat16: asked for; native bf16 ({', '.join(native)})")
        speedup = bf16_gemm_speedup(hidden, intermediate)
        _warn_emulated(speedup)
        return DtypeChoice(torch.bfloat16, f"bfloat16: asked for; this CPU has no native bf16 "
                                           f"arithmetic, the model's GEMMs measured {speedup:.2f}x "
                                           "float32's speed")
    if envs.get("BATCHINFER_CPU_AUTO_DTYPE").strip().lower() == "float32":
        return DtypeChoice(torch.float32, "float32: auto, as BATCHINFER_CPU_AUTO_DTYPE=float32 says")
    if not native:
        return DtypeChoice(torch.float32, "float32: this CPU has no native bf16 arithmetic "
                                          f"(neither {' nor '.join(NATIVE_BF16_FLAGS)})")
    speedup = bf16_gemm_speedup(hidden, intermediate)
    if speedup >= AUTO_MIN_SPEEDUP:
        return DtypeChoice(torch.bfloat16, f"bfloat16: native bf16 ({', '.join(native)}); the "
                                           f"model's GEMMs measured {speedup:.2f}x float32's speed")
    return DtypeChoice(torch.float32, f"float32: native bf16 ({', '.join(native)}), but the "
                                      f"model's GEMMs measured only {speedup:.2f}x float32's speed "
                                      f"in bf16 (auto needs {AUTO_MIN_SPEEDUP}x)")


@lru_cache(maxsize=None)
def _warn_emulated(speedup: float) -> None:
    log.warning("model.dtype bfloat16 on a CPU without native bf16 arithmetic (no %s): the weights "
                "are stored in bf16 and widened to fp32 for each multiply; the model's GEMMs "
                "measured %.2fx float32's speed here. dtype: auto picks float32 on this CPU",
                " or ".join(NATIVE_BF16_FLAGS), speedup)


def bf16_gemm_speedup(hidden: int, intermediate: int) -> float:
    """fp32 time / bf16 time of the model's MLP GEMMs at a decode step's rows, with the kernels
    the engine would run; measured once per machine and kernel build and kept in the kernel
    cache (setup_cache's build_once: one run measures, a concurrent one waits for its result)."""
    from .setup_cache import build_once, timeout_scale

    key = _check_key(hidden, intermediate)

    def measure_into(staging: Path) -> None:
        record = {"speedup": _measure(hidden, intermediate), "key": key}
        (staging / CHECK_FILE).write_text(json.dumps(record))

    entry = build_once(_check_dir(key), measure_into, what="timing bf16 against fp32 GEMMs",
                       wait_timeout_s=120 * timeout_scale(),
                       is_complete=lambda path: (path / CHECK_FILE).is_file())
    return float(json.loads((entry / CHECK_FILE).read_text())["speedup"])


def _check_key(hidden: int, intermediate: int) -> str:
    """What the measured speed-up depends on: the CPU, torch, the kernels' build (their sources:
    a faster kernel measures again) and the shape."""
    from .kernels import loaded_kernel_builds
    from .model.fast_linear import bf16_linear_kernel

    model, flags = cpu_identity()
    return json.dumps({"cpu": model, "flags": sorted(flags), "torch": torch.__version__,
                       "bf16_kernel": bf16_linear_kernel(), "kernel_builds": loaded_kernel_builds(),
                       "threads": torch.get_num_threads(), "shape": [CHECK_ROWS, hidden, intermediate],
                       "method": f"fastest of {CHECK_ROUNDS} interleaved rounds"},
                      sort_keys=True)


def _check_dir(key: str) -> Path:
    from .setup_cache import cache_root

    return cache_root() / "kernels" / f"dtype-check-{hashlib.sha256(key.encode()).hexdigest()[:20]}"


def speedup_of(fp32_seconds: list[float], bf16_seconds: list[float]) -> float:
    """fp32 / bf16 from interleaved rounds, each format's fastest: a busy neighbour only slows
    rounds, so the fastest is the machine's speed, where a median taken in a busy minute (0.58x
    once, on a CPU that measures 1.7-2.3x) was cached and decided every later run's dtype."""
    return min(fp32_seconds) / min(bf16_seconds)


def _measure(hidden: int, intermediate: int) -> float:
    from .model.fast_linear import pack_linears

    x = torch.randn(CHECK_ROWS, hidden, generator=torch.Generator().manual_seed(0))

    def mlp(weight_dtype: torch.dtype) -> torch.nn.Module:
        holder = torch.nn.ModuleDict({"gate_up": torch.nn.Linear(hidden, 2 * intermediate, bias=False),
                                      "down": torch.nn.Linear(intermediate, hidden, bias=False)})
        pack_linears(holder, weight_dtype=weight_dtype)
        return holder

    def timed(module: torch.nn.Module) -> float:
        t0 = time.perf_counter()
        module["down"](module["gate_up"](x)[:, :intermediate])
        return time.perf_counter() - t0

    started = time.perf_counter()
    # the layers' random init would draw from the process's generator: leave it as it was
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        modules = {dtype: mlp(dtype) for dtype in (torch.float32, torch.bfloat16)}
        for module in modules.values():
            timed(module)                       # first calls: page faults, oneDNN's JIT
        times = {dtype: [] for dtype in modules}
        for _ in range(CHECK_ROUNDS):
            for dtype, module in modules.items():
                times[dtype].append(timed(module))
    speedup = speedup_of(times[torch.float32], times[torch.bfloat16])
    log.info("dtype check: the model's MLP GEMMs at %d rows ran %.2fx float32's speed in bf16 "
             "(%.2f s, kept in the kernel cache)", CHECK_ROWS, speedup, time.perf_counter() - started)
    return speedup
