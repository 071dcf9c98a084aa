"""device.bind_threads: compute threads pinned one per core, helper threads and child processes
kept off that pinning. The pinning runs in a spawned child: pinned threads stay pinned for the
life of their process, and this one runs the rest of the suite."""
from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest

from batchinfer.engine.cpu_binding import plan_cpus


def test_plan_cpus_gives_each_process_its_own_run_of_cpus():
    assert plan_cpus(2, 0, 1, [0, 1]) == [0, 1]
    assert plan_cpus(1, 0, 2, [4, 5]) == [4]
    assert plan_cpus(1, 1, 2, [4, 5]) == [5]
    assert plan_cpus(2, 1, 2, [0, 1, 2, 3]) == [2, 3]
    assert plan_cpus(2, 0, 2, [0, 1, 2]) is None      # 4 threads, 3 CPUs: nothing pinned
    assert plan_cpus(1, 2, 2, [0, 1]) is None         # no such slot
    assert plan_cpus(0, 0, 1, [0, 1]) is None


def _thread_cpus() -> dict[int, set[int]]:
    """Each thread of this process -> the CPUs it may run on."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = set(os.sched_getaffinity(int(tid)))
        except OSError:         # the thread ended meanwhile
            pass
    return out


def _report_affinity(queue) -> None:
    queue.put(sorted(os.sched_getaffinity(0)))


def _pin_and_report(queue) -> None:
    try:
        suite_cpus = os.environ.get("TESTS_ALL_CPUS")    # tests/conftest.py: the pre-xdist CPUs
        if suite_cpus:      # this child may use them all again, so two threads pin to two CPUs
            os.sched_setaffinity(0, [int(c) for c in suite_cpus.split(",")])
        import torch

        from batchinfer.engine import cpu_binding

        cpus = cpu_binding.allowed_cpus()
        threads = min(2, len(cpus))
        pinned = cpu_binding.bind_compute_threads("auto", threads)
        torch.ones(1 << 16).sum()              # the pool at work after pinning
        main = sorted(os.sched_getaffinity(0))
        per_thread = [sorted(c) for c in _thread_cpus().values()]

        helper: dict = {}

        def helper_body():
            cpu_binding.release_helper_thread()
            helper["cpus"] = sorted(os.sched_getaffinity(0))

        t = threading.Thread(target=helper_body)
        t.start()
        t.join()

        ctx = mp.get_context("spawn")
        child_q = ctx.Queue()
        with cpu_binding.unpinned():
            proc = ctx.Process(target=_report_affinity, args=(child_q,))
            proc.start()
        child = child_q.get(timeout=120)
        proc.join()
        after = sorted(os.sched_getaffinity(0))
        queue.put({"cpus": cpus, "threads": threads, "pinned": pinned, "main": main,
                   "per_thread": per_thread, "helper": helper["cpus"], "child": child,
                   "after_unpinned": after})
    except BaseException as exc:                # report, never hang the parent
        queue.put({"error": repr(exc)})


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity (Linux)")
@pytest.mark.slow
def test_auto_pins_compute_threads_and_spares_helpers_and_children(monkeypatch):
    from batchinfer.engine.kernels import load_native_kernels

    if not load_native_kernels():
        pytest.skip("native kernels unavailable")
    monkeypatch.delenv("BATCHINFER_BIND_THREADS", raising=False)   # the child inherits this env
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_pin_and_report, args=(queue,))
    proc.start()
    result = queue.get(timeout=300)
    proc.join(timeout=60)
    assert "error" not in result, result.get("error")
    cpus, threads = result["cpus"], result["threads"]
    assert result["pinned"] == cpus[:threads]
    assert result["main"] == [cpus[0]]                     # OpenMP thread 0 is the caller
    if threads == 2:
        assert [cpus[1]] in result["per_thread"]           # and thread 1 has the next CPU
    spare = [c for c in cpus if c not in cpus[:threads]] or cpus
    assert result["helper"] == spare
    assert result["child"] == cpus                         # a process started unpinned
    assert result["after_unpinned"] == [cpus[0]]           # and the caller pinned again


def test_none_leaves_placement_alone(monkeypatch):
    import torch

    from batchinfer.engine import cpu_binding

    monkeypatch.delenv("BATCHINFER_BIND_THREADS", raising=False)
    threads = torch.get_num_threads()
    before = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    try:
        assert cpu_binding.bind_compute_threads("none", threads) is None
    finally:
        torch.set_num_threads(threads)
    if before is not None:
        assert sorted(os.sched_getaffinity(0)) == before


def test_numa_nodes_counts_the_nodes_a_cpu_set_spans(tmp_path):
    from batchinfer.engine.cpu_binding import numa_nodes, parse_cpu_list

    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    for node, cpus in [(0, "0-3"), (1, "4-7"), (2, "")]:      # node 2: memory only, no CPUs
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    assert numa_nodes([0, 1], sysfs=str(tmp_path)) == 1
    assert numa_nodes([3, 4], sysfs=str(tmp_path)) == 2
    assert numa_nodes([0], sysfs=str(tmp_path / "absent")) == 1    # no sysfs: one memory
