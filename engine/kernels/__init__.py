"""Compiled CPU kernels, built on first use with torch's extension builder and cached.

The cache key covers everything that changes the binary: the sources and headers, the compiler
flags, this CPU's instruction-set flags, the torch build (version and install path), the Python
build and the compiler. So a home directory shared between machines (NFS on a cluster) never
loads a binary built for another CPU, and two Python environments never rebuild each other's
entry. The build is crash-safe and shared (engine/setup_cache.py): a killed build never blocks a
later run, concurrent first runs build once. It runs in a child process with a bound; a build
failure falls back to the portable torch path with a warning, a build past its bound is an error.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .. import envs
from ..setup_cache import SetupTimeout, build_once, cache_root, discard, timeout_scale

log = logging.getLogger("batchinfer")
_DIR = Path(__file__).parent
# Two builds with different floating-point contracts:
# - the model kernels may reassociate (-ffast-math vectorizes their reductions and exps);
# - the "exact" kernels compute IEEE arithmetic as written (no fast-math, no FMA contraction):
#   the column-wise kernels (CPU samplers) must give bitwise the row kernels' results, which fast-math
#   breaks by reassociating double sums into vector partial sums, rewriting x / r as x * (1 / r)
#   and calling libmvec's vector expf for some std::exp; the int8 linears' per-token quantization
#   must round as torch's x * (127 / absmax) does. Their vector code uses intrinsics.
_BUILDS = {
    "model": ([_DIR / "paged_attention.cpp", _DIR / "fused_ops.cpp", _DIR / "blocked_linear.cpp",
               _DIR / "bf16_linear.cpp", _DIR / "amx_linear.cpp", _DIR / "encoder_attention.cpp",
               _DIR / "shm_allreduce.cpp", _DIR / "thread_binding.cpp"],
              ["-O3", "-ffast-math", "-fopenmp"]),
    "exact": ([_DIR / "sampling.cpp", _DIR / "sampling_columns.cpp", _DIR / "int8_linear.cpp"],
              ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
               "-fopenmp"]),
}
_LDFLAGS = ["-lm", "-fopenmp"]
# The two builds take about half a minute on 2 cores; past this they are stuck (scaled by
# BATCHINFER_SETUP_TIMEOUT_SCALE for slow shared file systems).
BUILD_TIMEOUT_S = 900.0
STOP_GRACE_S = 2.0
_WHAT = "building the CPU kernels"   # how lock waits and messages name this work
_loaded: Optional[bool] = None
_loaded_builds: tuple[str, ...] = ()   # the loaded libraries' cache names (sources, flags, host)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler_identity() -> str:
    """The C++ compiler torch's builder will run: its resolved path, size and mtime."""
    compiler = shutil.which(os.environ.get("CXX", "c++")) or os.environ.get("CXX", "c++")
    try:
        real = os.path.realpath(compiler)
        stat = os.stat(real)
        return f"{real}:{stat.st_size}:{int(stat.st_mtime)}"
    except OSError:
        return compiler


def build_name(build: str, sources: list[Path], cflags: list[str]) -> str:
    import torch

    digest = hashlib.sha256()
    for part in (torch.__version__, os.path.dirname(torch.__file__), sys.version,
                 sysconfig.get_paths()["include"], _compiler_identity(), platform.machine(),
                 _cpu_flags(), " ".join(cflags), " ".join(_LDFLAGS)):
        digest.update(part.encode())
        digest.update(b"\0")
    for path in sorted(sources) + sorted(_DIR.glob("*.h")):
        digest.update(path.read_bytes())
    return f"batchinfer_{build}_{digest.hexdigest()[:16]}"


def loaded_kernel_builds() -> tuple[str, ...]:
    """The cache names of the kernel libraries loaded (empty: none); each changes with the kernels'
    sources, so a result measured with one build (cpu_dtype's check) is not read for another."""
    load_native_kernels()
    return _loaded_builds


def load_native_kernels() -> bool:
    """Builds (once) and loads torch.ops.batchinfer.*. Returns False if unavailable."""
    global _loaded, _loaded_builds
    if _loaded is not None:
        return _loaded
    if envs.is_off("BATCHINFER_NATIVE_KERNELS"):
        _loaded = False
        return False
    import torch

    arch_flags = ["-march=native"] if platform.machine() in ("x86_64", "AMD64") else []
    try:
        root = cache_root() / "kernels"
        builds = []
        for name, (sources, flags) in _BUILDS.items():
            cflags = [*flags, *arch_flags]
            builds.append(Build(root / build_name(name, sources, cflags), sources, cflags))
        _build_missing(builds)
        for build in builds:
            _load_library(build)
        _loaded = (hasattr(torch.ops.batchinfer, "paged_attention")
                   and hasattr(torch.ops.batchinfer, "sample_columns"))
        _loaded_builds = tuple(build.entry.name for build in builds) if _loaded else ()
    except SetupTimeout:
        raise
    except Exception as exc:  # compiler missing, headers missing, ...: portable path instead
        log.warning("native CPU kernels unavailable (%s); using the torch path", exc)
        _loaded = False
    return _loaded


@dataclass(frozen=True)
class Build:
    """One kernel library: its cache entry (named by build_name), sources and flags."""
    entry: Path
    sources: list[Path]
    cflags: list[str]

    @property
    def library(self) -> Path:
        return self.entry / f"{self.entry.name}.so"

    def is_built(self) -> bool:
        return self.library.is_file()


def _wait_s() -> float:
    return (BUILD_TIMEOUT_S + 60) * timeout_scale()


def _build_missing(builds: list[Build]) -> None:
    """Builds every missing library at once (one compiler each: the two run side by side on 2
    cores), each under its entry's lock. The locks are taken in `builds` order, so two processes
    never wait on each other crosswise; an entry another process completed meanwhile is skipped."""
    staged: list[tuple[Build, Path]] = []

    def lock_from(i: int) -> None:
        if i == len(builds):
            _compile_all(staged)
            return
        entered = []

        def stage(staging: Path) -> None:
            entered.append(True)
            staged.append((builds[i], staging))
            lock_from(i + 1)    # the compilers run inside every staged entry's lock

        build_once(builds[i].entry, stage, what=_WHAT,
                   wait_timeout_s=_wait_s(), is_complete=lambda _: builds[i].is_built())
        if not entered:
            lock_from(i + 1)

    lock_from(0)


def _load_library(build: Build) -> None:
    import torch

    for attempt in (1, 2):
        try:
            torch.ops.load_library(str(build.library))
            return
        except OSError as exc:  # a damaged entry: build it again, once
            if attempt == 2:
                raise
            log.warning("the cached kernel library in %s does not load (%s); rebuilding it",
                        build.entry, exc)
            discard(build.entry, _WHAT, _wait_s())
            _build_missing([build])


def _compile_all(staged: list[tuple[Build, Path]]) -> None:
    """Runs compile.py once per library, all at once, each in a session of its own, bounded;
    stops every build on any exit."""
    if not staged:
        return
    bound = BUILD_TIMEOUT_S * timeout_scale()
    names = ", ".join(build.entry.name.split("_")[1] for build, _ in staged)
    log.warning("building the CPU kernels (%s): once per machine and Python environment, about "
                "half a minute on 2 cores", names)
    t0 = time.monotonic()
    running: list[tuple[subprocess.Popen, Path]] = []
    try:
        for build, staging in staged:
            running.append(_start_compile(build, staging))
        for proc, log_path in running:
            try:
                code = proc.wait(timeout=max(bound - (time.monotonic() - t0), 0.0))
            except subprocess.TimeoutExpired:
                tail = log_path.read_text(errors="replace")[-1500:]   # staging goes away
                raise SetupTimeout(f"building the CPU kernels took over {bound:.0f} s and was "
                                   "stopped; rerun, or set BATCHINFER_NATIVE_KERNELS=0 to use "
                                   f"the portable torch path. The build's last output:\n{tail}"
                                   ) from None
            if code != 0:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the kernel build failed (exit {code}):\n{tail}")
    finally:
        for proc, _ in running:
            if proc.poll() is None:
                _stop_session(proc)
    log.info("built the CPU kernels (%s) in %.0f s", names, time.monotonic() - t0)


def _start_compile(build: Build, staging: Path) -> tuple[subprocess.Popen, Path]:
    # One translation unit per library: torch's headers take 5-10 s to parse per file on 2
    # cores, which was most of the build when each source was compiled on its own.
    unit = staging / f"{build.entry.name}.cpp"
    unit.write_text("".join(f'#include "{path}"\n' for path in build.sources))
    args = {"name": build.entry.name, "sources": [str(unit)], "include": str(_DIR),
            "cflags": build.cflags, "ldflags": _LDFLAGS, "build_dir": str(staging),
            "parent_pid": os.getpid()}
    log_path = staging / "build.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(_DIR / "compile.py"), json.dumps(args)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=_compile_environment(), start_new_session=True)
    return proc, log_path


def _compile_environment() -> dict[str, str]:
    """This process's environment with PATH led by the directory of the `ninja` package this
    Python installed (a dependency): torch's builder runs `ninja` from PATH, and a job started
    by its full path (cron, Slurm, `venv/bin/batchinfer`) without the environment activated
    would otherwise build nothing and fall back to the slow torch path."""
    env = dict(os.environ)
    try:
        import ninja
        ninja_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):   # not installed here: PATH's own ninja, if any
        return env
    if ninja_dir and shutil.which("ninja", path=ninja_dir):
        env["PATH"] = os.pathsep.join(p for p in (ninja_dir, env.get("PATH")) if p)
    return env


def _stop_session(proc: subprocess.Popen) -> None:
    """SIGTERM to the build's session (ninja stops its compilers), then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
