"""TD-Pipe's Algorithm 1 on models with sliding windows: a block table whose layers see only
their last `window` keys releases the blocks behind it, so the forecast counts such a table up to
its window (policy.KVForecast's `windows`), in the pool's tokens, and the scheduler reads the
windows and the pool from its block manager (one table per KV layer group, or one windowed table
for a model windowed on every layer)."""
from __future__ import annotations

import random

import pytest

from batchinfer.engine.group_blocks import GroupedBlockManager
from batchinfer.engine.kv_cache import BlockManager
from batchinfer.engine.kv_groups import blocks_per_sequence
from batchinfer.sim.scheduler_driver import launch as _launch
from batchinfer.sim.scheduler_driver import make_seq as _seq
from batchinfer.strategies.tdpipe.policy import KVForecast
from batchinfer.strategies.tdpipe.scheduler import TDPipeParams, TDPipeScheduler
from tests.strategies.test_tdpipe import TABLE

BLOCK = 16


def brute_force_usage(points, windows, requests, count_ending):
    """Per point, each request's blocks as the block manager holds them for a decoding
    sequence (kv_groups.blocks_per_sequence), summed: at input + point while the request is
    predicted to run, and what it holds at its end at the first point after it."""
    usage = [0] * len(points)
    for input_len, predict_len in requests:
        rounded = -(-input_len // BLOCK) * BLOCK
        for index, point in enumerate(points):
            if point <= predict_len:
                usage[index] += blocks_per_sequence(windows, rounded + point, BLOCK) * BLOCK
        later = [i for i, p in enumerate(points) if p > predict_len]
        if count_ending and later and (later[0] == 0 or points[later[0] - 1] != predict_len):
            usage[later[0]] += blocks_per_sequence(windows, input_len + predict_len,
                                                   BLOCK) * BLOCK
    return usage


@pytest.mark.parametrize("windows", [(0,), (48,), (0, 48), (0, 16, 16), (0, 0, 100)])
@pytest.mark.parametrize("count_ending", [False, True])
def test_the_forecast_counts_each_table_as_the_block_manager_holds_it(windows, count_ending):
    """Random requests (inputs from 1 token to past every window, forecasts within and past the
    horizon): the map equals the per-point sum of what each request's tables hold."""
    rng = random.Random(hash((windows, count_ending)) & 0xffff)
    points = list(range(BLOCK, 160 + 1, BLOCK))
    forecast = KVForecast(points, 10**9, BLOCK, count_ending, windows=windows)
    requests = [(rng.randint(1, 200), rng.randint(0, 200)) for _ in range(60)]
    for input_len, predict_len in requests:
        forecast.update(input_len, predict_len)
    assert forecast.usage == brute_force_usage(points, windows, requests, count_ending)
    assert forecast.copy().usage == forecast.usage


def test_a_windowed_table_stops_growing_at_its_window():
    """A 100-token prompt decoding for 160 steps: a global table grows a block every 16 steps,
    a 48-token window's table holds ceil(48 / 16) + 1 = 4 blocks throughout."""
    points = [32, 96, 160]
    whole = KVForecast(points, 10**9, BLOCK)
    windowed = KVForecast(points, 10**9, BLOCK, windows=(0, 48))
    whole.update(100, 160)
    windowed.update(100, 160)
    assert whole.usage == [112 + 32, 112 + 96, 112 + 160]
    assert windowed.usage == [u + 4 * BLOCK for u in whole.usage]
    assert windowed.holds(1_000) == 1_008 + 4 * BLOCK


def _scheduler(block_manager) -> TDPipeScheduler:
    params = TDPipeParams(max_num_batched_tokens=64, future_point_interval=16,
                          future_point_horizon=256)
    sched = TDPipeScheduler(block_manager, params, max_model_len=512, depth=2)
    sched.step_times = TABLE
    return sched


def test_the_scheduler_forecasts_with_its_block_managers_windows_and_pool():
    """Gemma-like groups (a global table, a windowed one) in 64 blocks: the capacity is the pool
    (1,024 tokens), not one table's share of it, and the forecast counts the windowed table up to
    its window; a plain model's forecast is as before."""
    grouped = _scheduler(GroupedBlockManager(64, BLOCK, (0, 32)))
    assert grouped.capacity == pytest.approx(64 * BLOCK * grouped.params.kv_safety_ratio)
    assert grouped._running_forecast().windows == (0, 32)
    windowed = _scheduler(BlockManager(64, BLOCK, window=32))
    assert windowed._running_forecast().windows == (32,)
    plain = _scheduler(BlockManager(64, BLOCK))
    assert plain._running_forecast().windows == (0,)
    assert plain.capacity == pytest.approx(64 * BLOCK * plain.params.kv_safety_ratio)


def test_a_windowed_model_admits_what_its_windows_hold():
    """48-token prompts predicted to run 208 steps, in a pool of 96 blocks (1,536 tokens) whose
    second table is windowed (32 keys): at 256 tokens a request holds 16 global blocks and
    3 windowed ones (304 tokens), so 5 fit and Algorithm 1 as written launches the 6th, which
    crosses the capacity, before it switches. Counted as whole contexts (2 x 16 blocks), 3 would
    fit and the 4th cross."""
    sched = _scheduler(GroupedBlockManager(96, BLOCK, (0, 32)))
    for i in range(12):
        sched.add(_seq(i, 48, 208, predicted=208))
    admitted = 0
    while sched.phase == "prefill" and sched.waiting:
        admitted += sum(len(b) for b in _launch(sched))
    assert admitted == 6
    decision = sched.drain_decisions()[0]
    assert decision["switch"] == "prefill->decode"
    assert decision["predicted_kv_peak"] == pytest.approx(6 * 304 / 1536, abs=1e-3)
