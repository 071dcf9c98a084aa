"""Pinning a CPU process's compute threads to cores (`device.bind_threads`), as vLLM's CPU backend
does with VLLM_CPU_OMP_THREADS_BIND.

Unpinned, the OS may for a while run two of torch's OpenMP threads on one core (or move them
across NUMA nodes), and every GEMM waits at its barrier for the slowest. Opt-in: on the 2-core
CI machine the A/B was within its noise (README, "Thread pinning"). `auto` gives process `slot` of
`slots` on the host the slot-th run of `threads` CPUs among those this process may use
(os.sched_getaffinity: a Slurm or cgroup CPU set is respected); with fewer CPUs than
slots x threads nothing is pinned.

Pinning the pool pins the calling (main) thread too, and threads and processes it starts
afterwards inherit that one core: helper threads (input preparation, prefetchers) call
`release_helper_thread()` first, which moves them to the CPUs no compute thread holds (or all of
them if there are none), and processes are started inside `unpinned()` so that they see every
CPU this process was given.
"""
from __future__ import annotations

import contextlib
import glob
import logging
import os
from typing import Iterator, Optional

from . import envs

log = logging.getLogger(__name__)
_process_cpus: Optional[list[int]] = None    # this process's CPUs before any pinning
_pinned: list[int] = []                       # the compute threads' CPUs, once pinned


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, as it started (before bind_compute_threads)."""
    if _process_cpus is not None:
        return list(_process_cpus)
    if not hasattr(os, "sched_getaffinity"):
        return list(range(os.cpu_count() or 1))
    return sorted(os.sched_getaffinity(0))


def parse_cpu_list(text: str) -> set[int]:
    """A kernel CPU list ("0-3,8,10-11") -> its CPUs."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def numa_nodes(cpus: Optional[list[int]] = None,
               sysfs: str = "/sys/devices/system/node") -> int:
    """How many NUMA nodes `cpus` (default: this process's) span; 1 where sysfs does not say."""
    wanted = set(allowed_cpus() if cpus is None else cpus)
    nodes = 0
    for cpulist in sorted(glob.glob(os.path.join(sysfs, "node[0-9]*", "cpulist"))):
        try:
            with open(cpulist) as f:
                nodes += bool(parse_cpu_list(f.read()) & wanted)
        except (OSError, ValueError):
            continue
    return max(nodes, 1)


def compute_threads(num_threads: Optional[int]) -> int:
    """The recipe's `device.num_threads`, or every CPU this process may use that other
    processes do not keep busy (cpu_load.py: spinning threads wait on a shared core)."""
    if num_threads:
        return num_threads
    from .cpu_load import threads_beside_busy_cpus

    return threads_beside_busy_cpus(allowed_cpus())


def plan_cpus(threads: int, slot: int = 0, slots: int = 1,
              cpus: Optional[list[int]] = None) -> Optional[list[int]]:
    """The CPUs for process `slot` of `slots`, `threads` each; None when they do not fit."""
    cpus = allowed_cpus() if cpus is None else cpus
    if threads < 1 or slots * threads > len(cpus) or not 0 <= slot < slots:
        return None
    return cpus[slot * threads:(slot + 1) * threads]


def warn_if_oversubscribed(num_threads: Optional[int]) -> None:
    """The recipe's device.num_threads above the CPUs this process may use: said once at build
    (threads sharing a CPU wait on each other at every barrier, several-fold slower)."""
    usable = len(allowed_cpus())
    if num_threads and num_threads > usable:
        log.warning("device.num_threads: %d threads on the %d CPU(s) this process may use: "
                    "threads that share a CPU wait on each other at every barrier, which slows "
                    "the engine several-fold; leave it unset to take the usable CPUs",
                    num_threads, usable)


def bind_compute_threads(mode: str, threads: int, slot: int = 0, slots: int = 1) -> Optional[list[int]]:
    """Sets torch's intra-op threads to `threads` and, under mode `auto`, pins thread i to the
    i-th CPU of this process's slot. Returns the CPUs pinned, or None (mode `none`, too few
    CPUs, no sched_setaffinity, or the native kernels unavailable). BATCHINFER_BIND_THREADS
    (auto | none) in the environment overrides the mode (the test suite sets none: its runner
    process builds many engines and must not stay pinned)."""
    global _process_cpus, _pinned
    import torch

    torch.set_num_threads(threads)
    override = envs.get("BATCHINFER_BIND_THREADS")
    if override in ("auto", "none"):
        mode = override
    if mode == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    if _process_cpus is None:
        _process_cpus = allowed_cpus()
    from .cpu_load import known_busy

    busy = known_busy(_process_cpus)        # the free CPUs first: a busy one only if needed
    cpus = plan_cpus(threads, slot, slots, [c for c in _process_cpus if c not in busy]
                     + [c for c in _process_cpus if c in busy])
    if cpus is None:
        log.info("compute threads not pinned: %d process(es) x %d thread(s) need more than the "
                 "%d CPU(s) this process may use", slots, threads, len(_process_cpus))
        return None
    from .kernels import load_native_kernels

    if not load_native_kernels():
        log.info("compute threads not pinned: the native kernels are unavailable")
        return None
    if torch.ops.batchinfer.bind_threads(cpus) < len(cpus):
        log.warning("only some compute threads could be pinned to CPUs %s (the thread pool ran "
                    "a smaller team)", ",".join(map(str, cpus)))
    _pinned = list(cpus)
    log.info("compute threads pinned to CPUs %s", ",".join(map(str, cpus)))
    return cpus


def release_helper_thread() -> None:
    """Called first thing in a helper thread: off the compute cores when the process has others
    (so it does not take a pinned thread's core), else anywhere the process may run."""
    if not _pinned or _process_cpus is None:
        return
    spare = [c for c in _process_cpus if c not in _pinned] or _process_cpus
    try:
        os.sched_setaffinity(0, spare)
    except OSError as exc:      # a CPU set changed under us: stay where we are
        log.debug("helper thread kept its CPUs (%s)", exc)


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Starts processes inside this: the calling thread has this process's original CPUs for the
    while (a spawned process inherits its parent thread's CPU set)."""
    if not _pinned:
        yield
        return
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, _process_cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)
