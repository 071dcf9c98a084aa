"""Which of this process's CPUs other processes keep busy, read once at start.

torch's CPU threads meet at a barrier after every parallel region and spin while they wait. When
another process holds one of the cores, the thread that shares it runs in slices and every other
thread spins away its own core waiting for it: on a 2-core CI-class machine, a decode job with 2
threads and one core busy ran 3.4x slower than on the idle machine, and at 0.53x the speed of 1
thread beside the same neighbour (benchmarks/engine/busy_core.py, docs/performance.md). So
where the recipe leaves `device.num_threads` empty, the engine measures the CPUs for a moment
first and takes a thread per CPU that is free (cpu_binding.compute_threads), with a warning that
names the busy ones. BATCHINFER_CPU_BUSY_CHECK=0 skips the measurement (every allowed CPU is
taken).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from . import envs

log = logging.getLogger(__name__)

BUSY_FRACTION = 0.5          # a CPU busier than this over the probe is taken by someone else
PROBE_SECONDS = 0.1
_measured: dict[tuple[int, ...], dict[int, float]] = {}   # once per process and CPU set
_warned: set[tuple[int, ...]] = set()


def read_proc_stat(path: str = "/proc/stat") -> dict[int, tuple[int, int]]:
    """cpu number -> (busy jiffies, all jiffies) from the kernel's per-CPU counters; {} where
    they cannot be read (not Linux)."""
    out: dict[int, tuple[int, int]] = {}
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return out
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
            continue
        values = [int(v) for v in fields[:8]]          # user nice system idle iowait irq ...
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        out[int(name[3:])] = (sum(values) - idle, sum(values))
    return out


def cpu_busy_fractions(cpus: list[int], seconds: float = PROBE_SECONDS,
                       read: Callable[[], dict[int, tuple[int, int]]] = read_proc_stat,
                       sleep: Callable[[float], None] = time.sleep) -> dict[int, float]:
    """Each of `cpus`' busy share over `seconds` while this thread sleeps ({} where the counters
    cannot be read). This process's other threads count as busy too; at start they are few."""
    before = read()
    if not before:
        return {}
    sleep(seconds)
    after = read()
    shares = {}
    for cpu in cpus:
        if cpu in before and cpu in after:
            busy = after[cpu][0] - before[cpu][0]
            total = after[cpu][1] - before[cpu][1]
            shares[cpu] = busy / total if total > 0 else 0.0
    return shares


def busy_cpus(cpus: list[int]) -> dict[int, float]:
    """The CPUs among `cpus` that were over BUSY_FRACTION busy, with their share; measured once
    per process for a set of CPUs ({} with BATCHINFER_CPU_BUSY_CHECK=0)."""
    if envs.is_off("BATCHINFER_CPU_BUSY_CHECK"):
        return {}
    key = tuple(cpus)
    if key not in _measured:
        _measured[key] = cpu_busy_fractions(list(cpus))
    return {cpu: share for cpu, share in _measured[key].items() if share > BUSY_FRACTION}


def busy_text(busy: dict) -> str:
    """'0 (93%), 1 (88%)': busy CPUs and their busy shares, for warnings and records."""
    return ", ".join(f"{cpu} ({share:.0%})" for cpu, share in sorted(busy.items(),
                                                                    key=lambda i: int(i[0])))


def known_busy(cpus: list[int]) -> set[int]:
    """The CPUs of `cpus` this process has already found busy (busy_cpus), without measuring
    anew: pinning (cpu_binding) puts its threads on the free ones first."""
    shares = _measured.get(tuple(cpus), {})
    return {cpu for cpu, share in shares.items() if share > BUSY_FRACTION}


def threads_beside_busy_cpus(cpus: list[int],
                             busy: Optional[dict[int, float]] = None) -> int:
    """A thread per CPU of `cpus` that no other process keeps busy (all of them when every one
    is busy: there is nothing better to do), with a warning naming the busy ones (once per
    process)."""
    busy = busy_cpus(cpus) if busy is None else busy
    free = len(cpus) - len(busy)
    if not busy or free < 1:
        return len(cpus)
    key = tuple(cpus)
    if key in _warned:
        return free
    _warned.add(key)
    named = busy_text(busy)
    log.warning("CPU(s) %s of the %d this job may use are busy with other processes: the engine "
                "runs %d thread(s) instead of %d (threads waiting on a busy core stall the others: "
                "one fewer thread ran 1.9x faster in a measured case). Set device.num_threads to "
                "choose",
                named, len(cpus), free, len(cpus))
    return free
