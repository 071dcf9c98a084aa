"""Compiled CPU kernels, built on first use with torch's extension builder and cached.

The build cache is keyed by the source, the compiler flags and this CPU's instruction-set flags,
so a home directory shared between different machines (NFS on a cluster) never loads a binary
built for another CPU. Any build failure falls back to the portable torch path with a warning.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)
_DIR = Path(__file__).parent
# Two builds with different floating-point contracts:
# - the model kernels may reassociate (-ffast-math vectorizes their reductions and exps);
# - the sampling kernels compute IEEE arithmetic as written (no fast-math, no FMA contraction):
#   the column-wise kernels (SiPipe) must give bitwise the row kernels' results, which fast-math
#   breaks by reassociating double sums into vector partial sums, rewriting x / r as x * (1 / r)
#   and calling libmvec's vector expf for some std::exp. Their vector code uses intrinsics.
_BUILDS = {
    "model": ([_DIR / "paged_attention.cpp", _DIR / "fused_ops.cpp", _DIR / "blocked_linear.cpp",
               _DIR / "shm_allreduce.cpp", _DIR / "thread_binding.cpp"],
              ["-O3", "-ffast-math", "-fopenmp"]),
    "sampling": ([_DIR / "sampling.cpp", _DIR / "sampling_columns.cpp"],
                 ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
                  "-fopenmp"]),
}
_loaded: Optional[bool] = None


def _cpu_fingerprint() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return hashlib.sha256((platform.machine() + flags).encode()).hexdigest()[:10]


def cache_root() -> Path:
    base = os.environ.get("BATCHINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "batchinfer")
    return Path(base)


def load_native_kernels() -> bool:
    """Builds (once) and loads torch.ops.batchinfer.*. Returns False if unavailable."""
    global _loaded
    if _loaded is not None:
        return _loaded
    if os.environ.get("BATCHINFER_NATIVE_KERNELS", "1") == "0":
        _loaded = False
        return False
    import torch
    from torch.utils.cpp_extension import load

    arch_flags = ["-march=native"] if platform.machine() in ("x86_64", "AMD64") else []
    root = cache_root() / "kernels" / f"torch{torch.__version__.replace('+', '_')}"
    try:
        for build, (sources, flags) in _BUILDS.items():
            cflags = [*flags, *arch_flags]
            digest = hashlib.sha256(" ".join(cflags).encode())
            for path in sorted(sources) + sorted(_DIR.glob("*.h")):
                digest.update(path.read_bytes())
            name = f"batchinfer_{build}_{digest.hexdigest()[:10]}_{_cpu_fingerprint()}"
            build_dir = root / name
            build_dir.mkdir(parents=True, exist_ok=True)
            load(name=name, sources=[str(p) for p in sources], extra_include_paths=[str(_DIR)],
                 build_directory=str(build_dir), extra_cflags=cflags,
                 extra_ldflags=["-lm", "-fopenmp"], is_python_module=False, verbose=False)
        _loaded = (hasattr(torch.ops.batchinfer, "paged_attention")
                   and hasattr(torch.ops.batchinfer, "sample_columns"))
    except Exception as exc:  # compiler missing, headers missing, ...: portable path instead
        log.warning("native CPU kernels unavailable (%s); using the torch path", exc)
        _loaded = False
    return _loaded
