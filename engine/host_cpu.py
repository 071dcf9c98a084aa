"""The host's CPU model and instruction-set flags, read once from /proc/cpuinfo.

Torch-free on purpose: the benchmarks' host record (benchmarks/common.py) imports it before they
load torch, and engine/cpu_dtype.py decides the number format from the same flags.
"""
from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path

# the CPU features the kernels and the figures depend on
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


@lru_cache(maxsize=None)
def cpu_identity() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ("", {}) where it cannot be read."""
    model, flags = "", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags" and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def host_record() -> dict:
    """The machine a figure came from, for the records beside it: the CPU model and which of
    ISA_FLAGS it reports, its logical CPUs and those this process may use, memory."""
    model, flags = cpu_identity()
    info: dict = {"cpu": model or platform.processor() or platform.machine(),
                  "isa": [f for f in ISA_FLAGS if f in flags],
                  "cpus": os.cpu_count()}
    if hasattr(os, "sched_getaffinity"):
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    try:
        info["memory_gib"] = round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                                   / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return info
