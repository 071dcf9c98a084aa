"""The job loop's forecasts (runner/forecasts.py): on the predictor's own idle-priority thread,
returned in read order, its failures raised in the loop, its refits applied by the loop."""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest

from batchinfer.engine.request import FinishReason, Request, SamplingParams
from batchinfer.predictors.base import MeanPredictor
from batchinfer.predictors.online import OnlineLengthPredictor
from batchinfer.runner.forecasts import CHUNK, JobForecasts


def _pairs(n: int, start: int = 0) -> list:
    return [(f"spec{i}", Request(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=40)))
            for i in range(start, start + n)]


class _Spied(OnlineLengthPredictor):
    """The real online predictor, recording the threads it is called on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.threads: set = set()
        self.policies: set = set()

    def forecast(self, requests):
        self.threads.add(threading.get_ident())
        self.policies.add(os.sched_getscheduler(0))
        return super().forecast(requests)

    def observe(self, key, output_tokens, now=None):
        self.threads.add(threading.get_ident())
        return super().observe(key, output_tokens, now)


def _drain(forecasts: JobForecasts, engine) -> list:
    got = []
    while forecasts.pending:
        if forecasts.should_wait(engine):
            forecasts.wait()
        got.extend(forecasts.ready())
    return got


def test_forecasts_come_back_in_read_order_from_an_idle_priority_thread():
    predictor = _Spied(MeanPredictor(20.0))
    forecasts = JobForecasts(predictor, background=True)
    try:
        pairs = _pairs(3 * CHUNK + 5)
        forecasts.submit(pairs)
        idle = SimpleNamespace(has_unfinished=lambda: False, wants_requests=True)
        assert forecasts.should_wait(idle)
        got = _drain(forecasts, idle)
        assert [spec for spec, _ in got] == [spec for spec, _ in pairs]
        assert all(request.predicted_output_len == 20 for _, request in got)
        assert predictor.threads and threading.get_ident() not in predictor.threads
        if hasattr(os, "SCHED_IDLE"):
            assert predictor.policies == {os.SCHED_IDLE}
        assert forecasts.summary(10.0)["requests"] == len(pairs)
        assert not forecasts.should_wait(idle)           # nothing pending
    finally:
        forecasts.close()


def test_the_loop_waits_only_when_the_engine_would_run_short():
    forecasts = JobForecasts(OnlineLengthPredictor(MeanPredictor(20.0)), background=True)
    try:
        forecasts.submit(_pairs(2))
        busy = SimpleNamespace(has_unfinished=lambda: True, wants_requests=False)
        short = SimpleNamespace(has_unfinished=lambda: True, wants_requests=True)
        if forecasts.pending:
            assert not forecasts.should_wait(busy) and forecasts.should_wait(short)
        _drain(forecasts, short)
    finally:
        forecasts.close()


def test_refits_run_on_the_thread_and_the_loop_applies_them():
    predictor = _Spied(MeanPredictor(30.0), refit_every=4, min_examples=4, time_budget=None)
    forecasts = JobForecasts(predictor, background=True)
    idle = SimpleNamespace(has_unfinished=lambda: False, wants_requests=True,
                           progress=lambda: {})
    try:
        pairs = _pairs(12)
        forecasts.submit(pairs)
        _drain(forecasts, idle)
        done = [SimpleNamespace(request_id=f"r{i}", num_output_tokens=2,
                                finish_reason=FinishReason.STOP) for i in range(6)]
        forecasts.learn(idle, done, now=1.0)
        forecasts.flush()                 # the observations and the refit are done
        forecasts.ready()                 # the loop applies the re-forecasts
        assert threading.get_ident() not in predictor.threads
        assert predictor.refits == 1
        waiting = [request for _, request in pairs[6:]]
        assert all(request.predicted_output_len < 30 for request in waiting)
        assert forecasts.summary(10.0)["online"]["examples"] == 6
    finally:
        forecasts.close()


def test_a_failing_predictor_fails_the_loop_not_the_thread_silently():
    class Broken(MeanPredictor):
        def predict_queries(self, queries):
            raise RuntimeError("encoder exploded")

    forecasts = JobForecasts(Broken(5.0), background=True)
    try:
        forecasts.submit(_pairs(3))
        idle = SimpleNamespace(has_unfinished=lambda: False, wants_requests=True)
        with pytest.raises(RuntimeError, match="encoder exploded"):
            _drain(forecasts, idle)
    finally:
        forecasts.close()


def test_a_stop_drops_what_was_not_forecast_yet():
    forecasts = JobForecasts(OnlineLengthPredictor(MeanPredictor(5.0)), background=True)
    try:
        forecasts.submit(_pairs(4 * CHUNK))
        dropped = forecasts.drop()
        assert 0 < dropped <= 4 * CHUNK and forecasts.pending == 0
        assert forecasts.ready() == []
    finally:
        forecasts.close()


def test_in_the_loop_forecasts_are_ready_at_once():
    forecasts = JobForecasts(MeanPredictor(7.0), background=False)
    pairs = _pairs(5)
    forecasts.submit(pairs)
    assert forecasts.ready() == pairs and not forecasts.pending
    assert pairs[0][1].predicted_output_len == 7
    summary = forecasts.summary(1.0)
    assert summary["background"] is False and summary["waited_seconds"] >= 0
