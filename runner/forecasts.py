"""The job loop's side of the output-length predictor: requests go to the engine once forecast,
and finished ones teach the online predictor.

With `predictor.background` (the default) the predictor runs on a thread of its own at idle CPU
priority (Linux SCHED_IDLE: it gets a core only when nothing else wants one), forecasting the
read-ahead requests in chunks and refitting the online predictor, while the loop keeps stepping
the engine. A pipeline's stages leave cores idle while they wait on each other (TD-Pipe's stages
at PP=2 on two cores: 13-15% of the time), which is where the encoder then runs; the loop waits
for forecasts only when the engine would otherwise run short of requests (nothing unfinished, or
fewer prompt tokens waiting than its scheduler takes in a step or two: `Engine.wants_requests`),
and that wait is what the predictor costs the job (`waited_s`).
While the loop waits, the thread encodes on every core the engine lets it have. The predictor is
touched by that thread alone (its forecasts, refits and counters); the loop applies what it
returns, in the order the requests were read. Off, the forecasts and refits run in the loop
between engine steps, as they always did.
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from typing import Any, Optional

from .predictor_setup import apply_forecast, learn

log = logging.getLogger(__name__)

CHUNK = 16          # requests a forecast pass takes: a few encoder batches, ~50-80 ms on 2 cores


class JobForecasts:
    """Read-ahead (spec, request) pairs in, forecast pairs out (`ready`), in read order."""

    def __init__(self, predictor: Optional[Any], background: bool = True,
                 wait_threads: Optional[int] = None):
        self.predictor = predictor
        self.waited_s = 0.0                 # the loop's time blocked on forecasts (or computing them)
        self._ready: collections.deque = collections.deque()
        self._thread: Optional[_ForecastThread] = None
        if predictor is not None and background:
            self._thread = _ForecastThread(predictor, wait_threads)

    @property
    def background(self) -> bool:
        return self._thread is not None

    @property
    def pending(self) -> int:
        """Requests submitted whose forecasts the loop has not taken yet."""
        return (self._thread.pending if self._thread else 0) + len(self._ready)

    def submit(self, pairs: list) -> None:
        if not pairs:
            return
        if self.predictor is None:
            self._ready.extend(pairs)
        elif self._thread is None:
            t = time.perf_counter()
            requests = [request for _, request in pairs]
            for request, forecast in zip(requests, self.predictor.forecast(requests)):
                apply_forecast(request, forecast)
            self.waited_s += time.perf_counter() - t
            self._ready.extend(pairs)
        else:
            self._thread.submit(pairs)

    def ready(self) -> list:
        """The pairs forecast since the last call, in read order (re-forecasts applied too)."""
        if self._thread is not None:
            self._ready.extend(self._thread.take())
        out = list(self._ready)
        self._ready.clear()
        return out

    def should_wait(self, engine: Any) -> bool:
        """Whether the loop should block for forecasts before its next step: some are pending
        and the engine has nothing unfinished, or would run short of requests (its
        `wants_requests`: a pipeline's prefill would end for want of prompts)."""
        if self._thread is None or not self._thread.pending:
            return False
        return not engine.has_unfinished() or bool(getattr(engine, "wants_requests", False))

    def wait(self) -> None:
        """Blocks until the next chunk is forecast (or the thread failed: raised here)."""
        t = time.perf_counter()
        try:
            self._thread.wait()
        finally:
            self.waited_s += time.perf_counter() - t

    def learn(self, engine: Any, outputs: list, now: float) -> None:
        """One engine step's finished outputs: labelled examples for the online predictor."""
        if self.predictor is None or not outputs:
            return
        if self._thread is None:
            t = time.perf_counter()
            learn(self.predictor, engine, outputs, now)
            self.waited_s += time.perf_counter() - t
            return
        if getattr(self.predictor, "observe", None) is None:
            return
        from batchinfer.engine.request import FinishReason

        items = [(out.request_id, out.num_output_tokens
                  if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) else None)
                 for out in outputs]
        progress = getattr(engine, "progress", None)
        self._thread.observe(items, now, progress)

    def forget(self, request_id: str) -> None:
        """A request the engine refused: no length will come to learn from."""
        if self.predictor is None or not hasattr(self.predictor, "forget"):
            return
        if self._thread is None:
            self.predictor.forget(request_id)
        else:
            self._thread.observe([(request_id, None)], None, None)

    def drop(self) -> int:
        """The job stops: how many submitted requests never reached the engine."""
        dropped = self.pending
        self._ready.clear()
        if self._thread is not None:
            self._thread.discard()
        return dropped

    def summary(self, elapsed_s: float) -> Optional[dict]:
        """report.json's session.predictor (None without a predictor)."""
        if self.predictor is None:
            return None
        from .report.metrics import predictor_summary

        stats = self._thread.stats() if self._thread is not None else None
        out = predictor_summary(self.predictor, elapsed_s, stats)
        out["background"] = self._thread is not None
        out["waited_seconds"] = round(self.waited_s, 4)
        out["waited_share_of_job"] = round(self.waited_s / elapsed_s, 6) if elapsed_s > 0 else None
        return out

    def flush(self) -> None:
        """The input is done: the last finished requests' lessons are taken in (the report's
        examples and error timeline count every request)."""
        if self._thread is not None:
            t = time.perf_counter()
            try:
                self._thread.flush()
            finally:
                self.waited_s += time.perf_counter() - t

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()


class _ForecastThread:
    """The thread that owns the predictor while a job runs (see the module docstring)."""

    def __init__(self, predictor: Any, wait_threads: Optional[int]):
        import torch

        self.predictor = predictor
        self.wait_threads = wait_threads or torch.get_num_threads()
        self._inbox: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._done: collections.deque = collections.deque()   # forecast pairs, in read order
        self._reforecasts: list = []            # (request, forecast) from refits
        self._pending = 0                       # submitted, not yet taken by the loop
        self._generation = 0                    # discard() drops the forecasts of older ones
        self._error: Optional[BaseException] = None
        self._stats = predictor.stats()
        self._waited_on = False                 # the loop is blocked: encode on every core
        self._thread = threading.Thread(target=self._run, name="batchinfer-forecasts",
                                        daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def submit(self, pairs: list) -> None:
        with self._cond:
            self._pending += len(pairs)
            generation = self._generation
        for i in range(0, len(pairs), CHUNK):
            self._inbox.put(("forecast", generation, pairs[i:i + CHUNK]))

    def observe(self, items: list, now: Optional[float], progress) -> None:
        # the engine's progress is read here, in the loop's thread, between steps
        self._inbox.put(("observe", self._generation, (items, now, progress() if progress and
                                                       getattr(self.predictor, "due", None)
                                                       else None)))

    def take(self) -> list:
        with self._cond:
            self._raise_error()
            done, self._done = list(self._done), collections.deque()
            self._pending -= len(done)
            refits, self._reforecasts = self._reforecasts, []
        for request, forecast in refits:
            apply_forecast(request, forecast)
        return done

    def wait(self) -> None:
        with self._cond:
            self._waited_on = True
            try:
                while not self._done and self._pending and self._error is None:
                    self._cond.wait(0.5)
            finally:
                self._waited_on = False
            self._raise_error()

    def flush(self) -> None:
        done = threading.Event()
        with self._cond:
            self._waited_on = True
        try:
            self._inbox.put(("flush", self._generation, done))
            while not done.wait(0.5):
                if not self._thread.is_alive():
                    break
        finally:
            with self._cond:
                self._waited_on = False
            self._raise_error()

    def stats(self) -> dict:
        with self._cond:
            return self._stats

    def discard(self) -> None:
        """Forget what is queued (the job stops); a chunk being forecast finishes first."""
        with self._cond:
            self._generation += 1
            self._pending = 0
            self._done.clear()

    def close(self) -> None:
        self.discard()
        self._inbox.put(None)
        self._thread.join(timeout=30.0)     # at most the chunk under way

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # --- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        import torch

        _idle_priority()
        torch.get_num_threads()     # torch's per-thread start-up, before this thread's own count
        set_threads = _omp_threads_setter()
        threads = None
        while True:
            message = self._inbox.get()
            if message is None:
                return
            kind, generation, body = message
            if kind == "flush":
                body.set()              # every message before it is done
                continue
            with self._cond:
                stale = generation != self._generation
                wanted = self.wait_threads if self._waited_on else 1
            if stale:
                continue
            if wanted != threads and set_threads is not None:
                set_threads(wanted)     # one core beside the engine; all while the loop waits
                threads = wanted
            try:
                if kind == "forecast":
                    self._forecast(generation, body)
                else:
                    self._learn(*body)
            except BaseException as exc:  # noqa: BLE001 - the loop raises it
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
            with self._cond:
                self._stats = self.predictor.stats()

    def _forecast(self, generation: int, pairs: list) -> None:
        requests = [request for _, request in pairs]
        forecasts = self.predictor.forecast(requests)
        for request, forecast in zip(requests, forecasts):
            apply_forecast(request, forecast)
        with self._cond:
            if generation == self._generation:
                self._done.extend(pairs)
            self._cond.notify_all()

    def _learn(self, items: list, now: Optional[float], progress: Optional[dict]) -> None:
        """predictor_setup.learn's work, here: nothing in it can fail the job."""
        predictor = self.predictor
        try:
            for request_id, output_tokens in items:
                if output_tokens is None:
                    predictor.forget(request_id)
                else:
                    predictor.observe(request_id, output_tokens, now)
            if now is not None and predictor.due():
                changed = predictor.update(progress)
                with self._cond:
                    self._reforecasts.extend(changed)
        except Exception as exc:  # noqa: BLE001 - an optimisation never fails the job
            log.warning("online length predictor: %s: %s (the forecasts stay as they are)",
                        type(exc).__name__, exc)


def _omp_threads_setter():
    """OpenMP's omp_set_num_threads, which sets the calling thread's team size alone (torch's
    set_num_threads also changes process-wide settings the engine's threads read); None where
    the OpenMP runtime torch loaded is not libgomp."""
    import ctypes

    try:
        setter = ctypes.CDLL("libgomp.so.1").omp_set_num_threads
    except (OSError, AttributeError):
        return None
    setter.argtypes = [ctypes.c_int]
    return setter


def _idle_priority() -> None:
    """This thread (and the OpenMP threads it starts) at SCHED_IDLE where Linux has it."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as exc:
        log.debug("the forecast thread keeps its priority: %s", exc)
