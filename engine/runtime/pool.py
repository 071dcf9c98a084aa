"""The controller's side of the worker processes: spawn, control channel, fault detection, stop.

Each worker gets a duplex pipe (the control channel: plans out; results, timeline events and
errors back). Activations never touch it; they go rank to rank through torch.distributed, whose
rendezvous is a TCPStore the controller opens on a port the OS picks (no fixed ports: two runs on
one host never collide). Every wait here has a bound, and a worker that raises or dies (even by
kill -9) is noticed through its pipe or its process sentinel and named in the error.
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import defaultdict, deque
from multiprocessing.connection import Connection, wait
from typing import Optional

from ..cpu_binding import unpinned
from .timeline import PipelineStats

log = logging.getLogger("batchinfer")
# timeline events kept in memory, oldest dropped first: what a job's report draws
# (runner/job_report.py: the last 4,000), a few MB; a benchmark that reads the whole timeline raises it
# (Engine.keep_timeline). The per-rank totals (PipelineStats) count every event regardless.
EVENTS_KEEP = 4_096


class WorkerError(RuntimeError):
    """A worker raised, died or stopped answering. The message names the rank and the cause."""


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "is not answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _context():
    """Workers fork from a fork server that imported torch and the worker code once
    (fork_server.py); spawn where there is no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["batchinfer.engine.runtime.fork_server"])
    return ctx


def start_fork_server() -> None:
    """Starts the fork server now, so that its imports overlap the controller's own setup
    (tokenizer, plan); a no-op once it runs, or where there is none."""
    if _context().get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    # the server inherits SIGINT ignored: Python leaves an inherited SIG_IGN alone, so a Ctrl-C
    # while it still imports torch (before it ignores SIGINT itself) prints no traceback of its
    # own; the controller answers the signal (the spawn itself takes milliseconds)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        with unpinned():                 # the server's CPU set is every worker's
            forkserver.ensure_running()
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


def _child_main(target, spec, conn, environ: dict) -> None:
    """A worker's first step: the controller's environment as it is now (the fork server holds
    the one it started with), then the worker's own entry point."""
    os.environ.clear()
    os.environ.update(environ)
    target(spec, conn)


class WorkerPool:
    def __init__(self, rank_names: list[str], rank_meta: Optional[dict[int, dict]] = None):
        self.rank_names = rank_names
        self.stats = PipelineStats(rank_meta or {})
        self.procs: list = []
        self.conns: list[Connection] = []
        self.results: dict[int, deque] = defaultdict(deque)   # replica -> result messages
        # replica -> micro-batch -> stage -> tokens per expert of the stage's layers (a mixture
        # of experts: the stages before the last send them; the executor joins them to results)
        self.expert_loads: dict[int, dict[int, dict[int, list]]] = defaultdict(dict)
        # replica -> micro-batch -> scored prompt positions, from a last stage that does not
        # send the result itself (prompt_logprobs.py; the executor joins them to the result)
        self.prompt_scores: dict[int, dict[int, dict]] = defaultdict(dict)
        # (rank, transfer ids, seconds, the thread that copied)
        self.swapped: list[tuple[int, list[int], float, str]] = []
        self.worker_stats: dict[int, dict] = {}   # rank -> its latest (cumulative) counters
        self.infos: list[dict] = []               # what each process reported when ready
        self.events: deque = deque(maxlen=EVENTS_KEEP)
        self.store = None
        self.closed = False
        self._errors: list[str] = []
        self.plan_deltas = False   # executors send block tables as changes (plan_deltas.py)
        # tensors the workers map (e.g. through CUDA IPC): the controller holds them until the
        # workers are gone
        self.shared: list = []

    def keep_events(self, max_events: int) -> None:
        """Keeps up to `max_events` timeline events from now on (the newest of those held)."""
        self.events = deque(self.events, maxlen=max_events)

    def reset_timeline(self) -> None:
        """Forgets the events so far (e.g. a startup profile's micro-batches)."""
        self.stats = PipelineStats(self.stats.rank_meta)
        self.events.clear()

    # --- start ----------------------------------------------------------------------------------
    def start(self, target, specs: list, timeout_s: float, helpers: tuple = ()) -> list[dict]:
        """Spawns one process per spec (and per (target, spec) in `helpers`, e.g. CPU sampler
        processes, ranked after the workers), waits until each reports ready; -> their infos."""
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, None, True,
                                   timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        try:
            return self._start(target, specs, timeout_s, helpers)
        except BaseException:   # a signal, a timeout, a failed rank: no process left behind
            self.close(timeout_s=1.0)
            raise

    def _start(self, target, specs: list, timeout_s: float, helpers: tuple) -> list[dict]:
        ctx = _context()
        entries = [(target, spec) for spec in specs] + list(helpers)
        environ = dict(os.environ)
        for entry_target, spec in entries:
            parent, child = ctx.Pipe(duplex=True)
            spec.store_port = self.store.port
            proc = ctx.Process(target=_child_main, args=(entry_target, spec, child, environ),
                               daemon=True, name=f"batchinfer-rank{spec.rank}")
            with unpinned():
                proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        ready: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(ready) < len(entries):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [self.rank_names[r] for r in range(len(entries)) if r not in ready]
                self.close()
                raise WorkerError(f"workers not ready after {timeout_s:.0f} s: {', '.join(missing)} "
                                  "(raise parallel.startup_timeout_seconds for very large models)")
            for rank, msg in self._receive(left):
                if msg[0] == "ready":
                    ready[rank] = msg[2]
        self.infos = [ready[r] for r in range(len(entries))]
        return self.infos

    # --- messages -------------------------------------------------------------------------------
    def send(self, rank: int, message) -> None:
        try:
            self.conns[rank].send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._raise_dead(rank)

    def pump(self, timeout_s: float) -> None:
        """Handles every message that arrives within `timeout_s` (at least one) or raises."""
        got = self._receive(timeout_s)
        if not got:
            states = self._process_states()
            raise self._fail(f"no worker answered within {timeout_s:.0f} s (parallel."
                             "step_timeout_seconds); the ranks are alive but stuck"
                             + (f": {states}" if states else ""))
        self._handle(got)

    def _process_states(self) -> str:
        """Each rank's process state as the kernel reports it (Linux /proc), the unusual ones
        first: a stopped (SIGSTOP, a debugger) or running rank among sleeping ones is the
        likely culprit. "" where /proc cannot tell."""
        names = {"R": "running", "S": "waiting", "D": "in uninterruptible I/O",
                 "T": "stopped (SIGSTOP?)", "t": "stopped by a tracer", "Z": "a zombie"}
        found = []
        for rank, proc in enumerate(self.procs):
            try:
                with open(f"/proc/{proc.pid}/stat") as fh:
                    state = fh.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                return ""
            found.append((state == "S", f"{self.rank_names[rank]} (pid {proc.pid}) "
                                        f"{names.get(state, f'in state {state}')}"))
        return "; ".join(text for _, text in sorted(found, key=lambda item: item[0]))

    def poll(self) -> None:
        """Handles the messages already here, without waiting."""
        self._handle(self._receive(0))

    def _handle(self, got: list[tuple[int, tuple]]) -> None:
        for rank, msg in got:
            kind = msg[0]
            if kind == "result":
                self._add_events(msg[2].pop("events", ()))
                stats = msg[2].pop("stats", None)
                if stats is not None:
                    self.worker_stats[rank] = stats
                self.results[msg[1]].append(msg[2])
            elif kind == "events":
                self._add_events(msg[2])
            elif kind == "expert_load":
                self.expert_loads[msg[1]].setdefault(msg[2], {})[msg[3]] = msg[4]
            elif kind == "prompt_logprobs":
                self.prompt_scores[msg[1]][msg[2]] = msg[3]
            elif kind == "swapped":
                self.swapped.append((rank, msg[2], msg[3], msg[4]))
            elif kind == "stats":
                self.worker_stats[rank] = msg[2]

    def _add_events(self, events) -> None:
        self.events.extend(events)
        self.stats.add(events)

    def _receive(self, timeout_s: float) -> list[tuple[int, tuple]]:
        if self.closed:
            raise WorkerError("the worker processes were already stopped")
        index = {c: r for r, c in enumerate(self.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        ready = wait(list(index) + list(sentinels), timeout=timeout_s)
        out = []
        for obj in ready:
            if obj in index:
                rank = index[obj]
                try:
                    while obj.poll():
                        msg = obj.recv()
                        if msg[0] == "error":
                            raise self._fail(f"{self.rank_names[rank]} failed: {msg[2]}")
                        out.append((rank, msg))
                except (EOFError, OSError):
                    self._raise_dead(rank)
        for obj in ready:
            if obj in sentinels and not out:
                self._raise_dead(sentinels[obj])
        return out

    def _raise_dead(self, rank: int) -> None:
        proc = self.procs[rank]
        proc.join(timeout=1.0)
        raise self._fail(f"{self.rank_names[rank]} (pid {proc.pid}) {_describe_exit(proc.exitcode)}")

    def _fail(self, message: str) -> WorkerError:
        self.close()
        return WorkerError(message)

    # --- stop -----------------------------------------------------------------------------------
    def close(self, timeout_s: float = 5.0) -> None:
        """Asks every worker to stop, then kills the stragglers."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:   # workers ignore SIGTERM (the controller's to answer)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)
        for conn in self.conns:
            conn.close()
        self.store = None
        if self.shared:
            cuda = any(getattr(t, "is_cuda", False) for t in self.shared)
            self.shared.clear()
            if cuda:
                import torch

                torch.cuda.ipc_collect()    # memory the workers mapped goes back now
