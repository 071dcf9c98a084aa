"""The host's CPU model and instruction-set flags, read once from /proc/cpuinfo.

Torch-free on purpose: the benchmarks' host record (benchmarks/common.py) imports it before they
load torch, and engine/cpu_dtype.py decides the number format from the same flags.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path


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
