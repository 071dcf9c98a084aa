"""engine/cpu_load.py: the CPUs other processes keep busy, and the thread count taken beside them
when device.num_threads is empty."""
from __future__ import annotations

import logging

import pytest
import torch

from batchinfer.engine import cpu_binding, cpu_load

STAT = """cpu  300 0 100 600 0 0 0 0 0 0
cpu0 100 0 50 300 0 0 0 0 0 0
cpu1 200 0 50 300 0 0 0 0 0 0
intr 12345
"""


def test_proc_stat_gives_busy_and_total_jiffies_per_cpu(tmp_path):
    path = tmp_path / "stat"
    path.write_text(STAT)
    assert cpu_load.read_proc_stat(str(path)) == {0: (150, 450), 1: (250, 550)}
    assert cpu_load.read_proc_stat(str(tmp_path / "missing")) == {}


def test_busy_fractions_are_the_counters_deltas_over_the_probe():
    reads = iter([{0: (100, 1000), 1: (100, 1000)}, {0: (190, 1100), 1: (110, 1100)}])
    slept = []
    shares = cpu_load.cpu_busy_fractions([0, 1], 0.25, read=lambda: next(reads),
                                         sleep=slept.append)
    assert slept == [0.25]
    assert shares == pytest.approx({0: 0.9, 1: 0.1})
    assert cpu_load.cpu_busy_fractions([0], read=dict) == {}        # no counters: no opinion


def test_this_hosts_counters_read_as_shares():
    cpus = cpu_binding.allowed_cpus()
    shares = cpu_load.cpu_busy_fractions(cpus, 0.05)
    if not shares:
        pytest.skip("no /proc/stat here")
    assert set(shares) <= set(cpus) and all(0.0 <= s <= 1.0 for s in shares.values())


def test_threads_go_to_the_free_cpus_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(cpu_load, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="batchinfer.engine.cpu_load"):
        assert cpu_load.threads_beside_busy_cpus([0, 1, 2, 3], {2: 0.97}) == 3
        assert cpu_load.threads_beside_busy_cpus([0, 1, 2, 3], {2: 0.97}) == 3
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "CPU(s) 2 (97%) of the 4" in warnings[0] and "3 thread(s) instead of 4" in warnings[0]
    assert "device.num_threads" in warnings[0]
    assert cpu_load.threads_beside_busy_cpus([0, 1], {}) == 2
    assert cpu_load.threads_beside_busy_cpus([0, 1], {0: 0.9, 1: 0.8}) == 2   # all busy: all


def test_compute_threads_measures_only_when_the_recipe_leaves_it_empty(monkeypatch):
    monkeypatch.setattr(cpu_binding, "allowed_cpus", lambda: [0, 1])
    monkeypatch.setattr(cpu_load, "_warned", set())
    monkeypatch.setattr(cpu_load, "_measured", {(0, 1): {0: 0.05, 1: 0.99}})
    monkeypatch.setenv("BATCHINFER_CPU_BUSY_CHECK", "1")
    assert cpu_binding.compute_threads(None) == 1
    assert cpu_binding.compute_threads(2) == 2                    # asked for: as asked
    monkeypatch.setenv("BATCHINFER_CPU_BUSY_CHECK", "0")
    assert cpu_binding.compute_threads(None) == 2                 # the check switched off


def test_pinning_puts_threads_on_the_cpus_found_free(monkeypatch):
    """The CPUs measured busy go last in the pinning plan, so one fewer thread than CPUs lands
    on the free ones; nothing measured, the plain order."""
    monkeypatch.setattr(cpu_load, "_measured", {(0, 1, 2, 3): {0: 0.97, 1: 0.0, 2: 0.1, 3: 0.0}})
    assert cpu_load.known_busy([0, 1, 2, 3]) == {0}
    assert cpu_load.known_busy([0, 1]) == set()
    calls = []
    monkeypatch.setattr(cpu_binding, "_process_cpus", [0, 1, 2, 3])
    monkeypatch.setattr(cpu_binding, "plan_cpus",
                        lambda threads, slot, slots, cpus: calls.append(cpus) or None)
    monkeypatch.setenv("BATCHINFER_BIND_THREADS", "auto")
    monkeypatch.setattr(cpu_binding.os, "sched_setaffinity", lambda *a: None, raising=False)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)   # this process keeps its own
    assert cpu_binding.bind_compute_threads("auto", 3) is None
    assert calls == [[1, 2, 3, 0]]
