"""TD-Pipe (strategies/tdpipe/scheduler.py): the three decisions on hand-made states, the scheduler driven
by hand, and an end-to-end PP=2 run whose greedy outputs equal the baseline's."""
from __future__ import annotations

import json

import pytest

from batchinfer.engine.errors import ConfigError
from batchinfer.engine.kv_cache import BlockManager
from batchinfer.runner.recipe import parse_recipe
from batchinfer.runner.recipe_errors import RecipeError
from batchinfer.engine.request import SequenceStatus
from batchinfer.engine.step_times import StepTimes
from batchinfer.strategies.tdpipe.scheduler import TDPipeParams, TDPipeScheduler
from batchinfer.strategies.tdpipe.policy import (KVForecast, WorkStealing, future_points,
                                                 pack_prefill, spatial_intensity,
                                                 temporal_intensity)
from batchinfer.sim.scheduler_driver import complete as _complete
from batchinfer.sim.scheduler_driver import launch as _launch
from batchinfer.sim.scheduler_driver import make_seq as _seq
from tests.strategy_e2e import (E2E_PARAMS, E2E_PROMPTS, TIGHT, assert_context_dependent,
                                 run_shipped_recipe, tight_reference)

TABLE = StepTimes(decode=[(1, 0.010), (16, 0.020), (64, 0.040), (256, 0.128)],
                  prefill=[(64, 0.030), (256, 0.100), (1024, 0.400)])


# --- Approach 1: Algorithm 1 ------------------------------------------------------------------------
def test_future_points_default_is_every_32_steps_up_to_1024():
    points = future_points()
    assert points[0] == 32 and points[-1] == 1024 and len(points) == 32


def test_forecast_adds_input_plus_point_up_to_the_predicted_length():
    forecast = KVForecast([32, 64, 96], capacity_tokens=1000)
    forecast.update(input_len=100, predict_len=70)    # alive at 32 and 64, gone by 96
    forecast.update(input_len=10, predict_len=96)     # alive at all three
    forecast.update(input_len=500, predict_len=31)    # finishes before the first point
    assert forecast.usage == [132 + 42, 164 + 74, 106]
    assert forecast.peak() == 238 and not forecast.should_switch()
    forecast.update(input_len=900, predict_len=40)
    assert forecast.usage[0] == 174 + 932 and forecast.should_switch()
    assert forecast.at_step(0) == forecast.usage[0] and forecast.at_step(65) == 106
    assert forecast.at_step(97) == 0


def test_forecast_counts_whole_blocks_as_the_paged_cache_holds_them():
    forecast = KVForecast([32, 64], capacity_tokens=1000, block_size=16)
    forecast.update(input_len=17, predict_len=64)     # 17 tokens take 2 blocks: 32, then + point
    forecast.update(input_len=32, predict_len=40)
    assert forecast.usage == [64 + 64, 96]
    # what a block manager really holds at each point (blocks x 16)
    for point, usage in zip((32, 64), forecast.usage):
        held = sum(-(-(n + point) // 16) * 16 for n, left in ((17, 64), (32, 40)) if left >= point)
        assert usage == held
    assert forecast.copy().usage == forecast.usage


def test_counting_ending_requests_sees_replies_shorter_than_a_point_interval():
    literal = KVForecast([32, 64], capacity_tokens=300, count_ending=False)
    counted = KVForecast([32, 64], capacity_tokens=300, count_ending=True)
    for forecast in (literal, counted):
        for _ in range(3):
            forecast.update(input_len=100, predict_len=10)   # gone before point 32
        forecast.update(input_len=20, predict_len=64)         # alive at both points
        forecast.update(input_len=50, predict_len=40)         # ends between 32 and 64
    # literally: the three short replies are invisible, though they hold 3 x 110 tokens at step 10
    assert literal.usage == [52 + 82, 84] and not literal.should_switch()
    # counted: each at the first point after its end, with what it holds then (input + length)
    assert counted.usage == [52 + 82 + 3 * 110, 84 + 90] and counted.should_switch()
    # a request ending exactly on a point is counted there already, not twice
    exact = KVForecast([32, 64], capacity_tokens=1000, count_ending=True)
    exact.update(input_len=10, predict_len=32)
    assert exact.usage == [42, 0]
    # beyond the horizon nothing ends within it
    beyond = KVForecast([32, 64], capacity_tokens=1000, count_ending=True)
    beyond.update(input_len=10, predict_len=100)
    assert beyond.usage == [42, 74] and beyond.copy().usage == beyond.usage


@pytest.mark.parametrize("within", [True, False])
def test_a_phase_of_short_replies_ends_on_the_forecast_not_on_a_full_cache(within):
    """Prompts of 48 tokens with 5-token replies: literally, Algorithm 1 sees none of them (they
    end before the first point, 8) and prefills until the cache is full."""
    peaks, reasons = {}, {}
    for counted in (True, False):
        sched = _scheduler(num_blocks=16, count_ending_requests=counted,   # 256 tokens
                           admit_within_capacity=within)
        for i in range(12):
            sched.add(_seq(i, 48, 5, predicted=5))
        while sched.phase == "prefill":
            batches = _launch(sched)
            for batch in batches:
                _complete(sched, batch)
            if not batches:
                break
        decision = sched.drain_decisions()[0]
        reasons[counted], peaks[counted] = decision["reason"], decision["predicted_kv_peak"]
    # each holds 48 + 5 tokens (4 blocks) at its end: the 5th is forecast over the 16 blocks;
    # as written it is launched all the same, within the capacity it waits
    assert reasons == {True: "predicted KV peak exceeds capacity", False: "KV cache full"}
    assert peaks[True] == pytest.approx((4 if within else 5) * 64 / 256)
    assert peaks[False] == 0                                        # literally: blind


# --- Approach 2: inter-batch work stealing, the paper's Fig. 9 ----------------------------------------
def test_work_stealing_reproduces_figure_9():
    stealing = WorkStealing(depth=4)
    stealing.pool = list(range(512))
    batches = [stealing.next_batch([], 0) for _ in range(4)]     # the initial even split
    assert [len(b) for b in batches] == [128, 128, 128, 128] and not stealing.pool
    # batch 0 returns: 48 finished, 80 remain -> average 116, all 80 resubmitted
    b0 = stealing.next_batch(batches[0][:80], finished=48)
    assert stealing.last_average == 116 and len(b0) == 80
    # batch 1: 8 finished -> average 114, 6 stolen, 114 submitted
    b1 = stealing.next_batch(batches[1][:120], finished=8)
    assert stealing.last_average == 114 and len(b1) == 114 and len(stealing.pool) == 6
    # batches 2 and 3: nothing finished, each trimmed to the average
    b2 = stealing.next_batch(batches[2], finished=0)
    b3 = stealing.next_batch(batches[3], finished=0)
    assert (len(b2), len(b3)) == (114, 114) and len(stealing.pool) == 34
    # next iteration: the stolen requests go to batch 0, and every batch holds 114
    b0 = stealing.next_batch(b0, finished=0)
    assert stealing.last_average == 114 and len(b0) == 114 and not stealing.pool
    assert sorted(b0 + b1 + b2 + b3) == sorted(set(b0 + b1 + b2 + b3))    # nobody twice


def test_work_stealing_off_keeps_the_batches_as_they_are():
    stealing = WorkStealing(depth=4, enabled=False)
    stealing.pool = list(range(512))
    batches = [stealing.next_batch([], 0) for _ in range(4)]
    assert [len(b) for b in batches] == [128] * 4
    assert len(stealing.next_batch(batches[0][:80], finished=48)) == 80
    assert len(stealing.next_batch(batches[1][:120], finished=8)) == 120
    assert not stealing.pool


# --- Approach 3: spatial vs temporal intensity ----------------------------------------------------------
def test_spatial_intensity_is_achieved_over_peak_rate():
    peak = 256 / 0.128                                       # the best requests / second
    assert spatial_intensity(TABLE, 256) == pytest.approx(1.0)
    assert spatial_intensity(TABLE, 16) == pytest.approx((16 / 0.020) / peak)
    assert spatial_intensity(TABLE, 40) == pytest.approx((40 / 0.030) / peak)   # interpolated
    assert spatial_intensity(TABLE, 0) == 0.0


def test_temporal_intensity_is_one_minus_bubble_over_total():
    # three pending prefill micro-batches of 1024, 256 and 64 tokens; decode batch of 16, PP=2
    value, bubble, total = temporal_intensity(TABLE, [1024, 256, 64], 16, depth=2)
    assert bubble == pytest.approx(0.400 - 0.020)
    assert total == pytest.approx(0.400 + 0.100 + 0.030 + 2 * 0.020 + bubble)
    assert value == pytest.approx(1 - bubble / total)
    assert temporal_intensity(TABLE, [], 16, depth=2)[0] == 0.0
    assert pack_prefill([100, 900, 30, 2000, 10], 1024) == [1000, 30, 2000, 10]


# --- the scheduler, driven by hand ---------------------------------------------------------------------
def _scheduler(num_blocks=64, depth=2, **params) -> TDPipeScheduler:
    p = TDPipeParams(max_num_batched_tokens=64, future_point_interval=8,
                     future_point_horizon=64, **params)
    sched = TDPipeScheduler(BlockManager(num_blocks, 16, watermark=0.0), p, max_model_len=512,
                            depth=depth)
    sched.step_times = TABLE
    return sched


@pytest.mark.parametrize("within", [True, False])
def test_greedy_prefill_switches_when_the_predicted_peak_exceeds_the_capacity(within):
    sched = _scheduler(num_blocks=16, admit_within_capacity=within)      # 256 tokens
    for i in range(8):                                       # 32-token prompts, 40 predicted tokens
        sched.add(_seq(i, 32, 100, predicted=40))
    first = _launch(sched)[0]
    assert first.phase == "prefill" and len(first) == 2      # 64-token budget
    assert sched.phase == "prefill"                          # 2 x (32 + 40) = 144 at point 8..40
    second = _launch(sched)[0]
    # 4 requests: at point 8 they hold 4 x 40 = 160 tokens; at point 40, 4 x 72 = 288 > 256.
    # Algorithm 1 as written launches the 4th and then switches; within the capacity the 4th
    # waits for the next prefill phase
    assert len(second) == (1 if within else 2) and sched.phase == "decode"
    decision = sched.drain_decisions()[0]
    assert decision["switch"] == "prefill->decode"
    assert decision["reason"] == "predicted KV peak exceeds capacity"
    assert decision["predicted_kv_peak"] == pytest.approx((216 if within else 288) / 256,
                                                          abs=1e-3)
    assert [s.request_id for s in sched.waiting][0] == ("r3" if within else "r4")


def test_within_the_capacity_a_job_whose_forecasts_are_right_is_never_preempted():
    """Exact forecasts, a cache of 10 requests' peaks: Algorithm 1 as written launches the batch
    that crosses the capacity and preempts its excess in decode; held back, nothing is
    preempted, and the decode -> prefill comparison is only made when the queue's head fits, so
    the phases do not flip back and forth over a head that cannot start."""
    preempted, switches = {}, {}
    for within in (True, False):
        sched = _scheduler(num_blocks=30, depth=2, admit_within_capacity=within)   # 480 tokens
        for i in range(24):                     # 16-token prompts, 32 tokens each: 3 blocks
            sched.add(_seq(i, 16, 32, predicted=32))
        launched = _drive(sched, 2, stop_on_prefill=False, max_steps=2000)
        assert not sched.running and not sched.waiting
        assert {item.seq.request_id for b in launched for item in b.items} == \
            {f"r{i}" for i in range(24)}
        sched.block_manager.check_invariants()
        preempted[within], switches[within] = sched.num_preemptions, sched.num_switches
    assert preempted[False] > 0 and preempted[True] == 0, preempted
    assert switches[True] <= 8, switches            # three phases of up to 10 requests each


def test_auto_bets_on_the_forecasts_until_the_job_preempts():
    """admit_within_capacity: auto launches the batch that crosses the capacity, as Algorithm 1
    is written, until a request is preempted; from then on such a prompt waits."""
    first_phase, preempted = {}, {}
    for mode in ("auto", False, True):
        sched = _scheduler(num_blocks=30, depth=2, admit_within_capacity=mode)
        for i in range(36):             # exact forecasts of 16 + 32 tokens: 10 fit the cache
            sched.add(_seq(i, 16, 32, predicted=32))
        _drive(sched, 2, stop_on_prefill=False, max_steps=4000)
        assert not sched.running and not sched.waiting
        switches = [d for d in sched.drain_decisions() if d["switch"] == "prefill->decode"]
        first_phase[mode], preempted[mode] = switches[0]["running"], sched.num_preemptions
    assert _scheduler().params.admit_within_capacity == "auto"      # the default
    # the first phase takes the crossing batch (12 requests) as written; held back, 10
    assert first_phase == {"auto": 12, False: 12, True: 10}
    # auto stops betting after its first preemptions; as written every phase overflows
    assert 0 == preempted[True] < preempted["auto"] < preempted[False], preempted


@pytest.mark.parametrize("within", [True, False])
def test_the_first_request_of_a_phase_starts_whatever_its_forecast(within):
    """With nothing running, a prompt forecast past the capacity on its own still starts (it
    would otherwise never run); within the capacity the next one waits."""
    sched = _scheduler(num_blocks=6, admit_within_capacity=within)      # 96 tokens
    sched.add(_seq(0, 40, 200, predicted=200))      # 48 + 64 (the horizon) = 112 > 96
    sched.add(_seq(1, 16, 200, predicted=4))        # fits the cache and the 64-token budget
    batch = _launch(sched)[0]
    assert [item.seq.request_id for item in batch.items] == (["r0"] if within else ["r0", "r1"])
    assert sched.phase == "decode"


def test_forecast_fits_is_a_trial_update():
    forecast = KVForecast([32, 64], capacity_tokens=200)
    forecast.update(input_len=50, predict_len=64)
    before = forecast.usage
    assert forecast.fits(10, 40) and not forecast.fits(60, 64)
    assert forecast.usage == before                          # nothing was added


@pytest.mark.parametrize("doubling", [True, False])
def test_a_request_past_its_forecast_is_planned_for_as_long_again(doubling):
    """overdue_doubling: a reply that outlived its forecast is expected to run as long again as
    it has so far, within its cap; off: one future-point interval (8 here) at a time."""
    sched = _scheduler(overdue_doubling=doubling)
    seq = _seq(0, 32, 100, predicted=10)
    seq.output_token_ids.extend([7] * 5)
    assert sched.predicted_remaining(seq) == 5                     # inside its forecast: as told
    seq.output_token_ids.extend([7] * 35)                           # 40 generated, 30 past it
    assert sched.predicted_remaining(seq) == (40 if doubling else 8)
    seq.output_token_ids.extend([7] * 40)                           # 80 of its 100
    assert sched.predicted_remaining(seq) == (20 if doubling else 8)


def _fill_like_the_engine(sched, depth: int) -> list:
    """The engine's _fill: launch while fewer than the scheduler's limit are in flight."""
    in_flight = []
    while len(in_flight) < sched.in_flight_limit(depth):
        nxt = _launch(sched)
        if not nxt:
            break
        in_flight.extend(nxt)
    return in_flight


@pytest.mark.parametrize("ahead", [True, False])
def test_prefills_are_sent_on_without_waiting_for_results(ahead):
    """§3.2.1: the engine sends prefills to the workers until the switch, not one per stage."""
    sched = _scheduler(num_blocks=64, depth=2, launch_prefills_ahead=ahead)
    for i in range(12):
        sched.add(_seq(i, 32, 100, predicted=8))               # 2 per 64-token micro-batch
    in_flight = _fill_like_the_engine(sched, depth=2)
    assert [b.phase for b in in_flight] == ["prefill"] * (4 if ahead else 2)
    assert sched.phase == "prefill"
    for batch in in_flight:                                    # the results come back
        _complete(sched, batch)
    sched.phase = "decode"
    assert sched.in_flight_limit(2) == 2                      # decode: exactly PP in flight
    assert _scheduler(depth=1).in_flight_limit(1) == 1        # no pipeline: nothing to overlap


def test_occupancy_ratio_ablation_switches_on_blocks_in_use():
    sched = _scheduler(num_blocks=16, greedy_prefill=False, kv_occupancy_ratio=0.25)
    for i in range(8):
        sched.add(_seq(i, 32, 100, predicted=1000))
    _launch(sched)                                           # 4 of 16 blocks: 25%
    assert sched.phase == "decode"
    assert sched.drain_decisions()[0]["reason"] == "KV occupancy ratio reached"


STEEP = StepTimes(decode=[(1, 0.010), (4, 0.011), (8, 0.012), (256, 0.300)],
                  prefill=[(16, 0.500), (64, 0.600)])


def _drive(sched, depth, late=None, stop_on_prefill=True, max_steps=200):
    """Keeps `depth` micro-batches in flight like the engine; adds `late` once decoding starts.
    -> the launched micro-batches, in order."""
    in_flight, launched = [], []
    for _ in range(max_steps):
        while len(in_flight) < depth:
            nxt = _launch(sched)
            if late is not None and sched.phase == "decode" and late.status is SequenceStatus.WAITING \
                    and late not in sched.waiting:
                sched.add(late)
            if not nxt:
                break
            in_flight.extend(nxt)
            launched.extend(nxt)
            if stop_on_prefill and nxt[0].phase == "prefill" and late is not None \
                    and any(item.seq is late for item in nxt[0].items):
                return launched
        if not in_flight:
            break
        _complete(sched, in_flight.pop(0))
    return launched


def test_decode_phase_keeps_pp_even_batches_and_returns_to_prefill_on_intensity():
    sched = _scheduler(num_blocks=64, depth=2)
    sched.step_times = STEEP
    for i in range(16):       # half finish after 2 tokens, half run for 40
        sched.add(_seq(i, 16, 2 if i % 2 else 40, predicted=8))
    late = _seq(99, 16, 5, predicted=8)
    launched = _drive(sched, 2, late=late)
    decode = [b for b in launched if b.phase == "decode"]
    sizes = [len(b) for b in decode]
    # once every prefill is back, the two batches stay within one request of each other
    assert all(abs(a - b) <= 1 for a, b in zip(sizes[2:], sizes[3:])), sizes
    assert launched[-1].items[0].seq is late and sched.phase == "prefill"
    switch = [d for d in sched.drain_decisions() if d["switch"] == "decode->prefill"]
    assert len(switch) == 1 and switch[0]["reason"] == "spatial < temporal intensity"
    x = switch[0]
    assert x["spatial"] < x["temporal"] and x["decode_batch_size"] <= 4
    assert x["spatial"] == pytest.approx(spatial_intensity(STEEP, x["decode_batch_size"]), abs=1e-4)
    # while the batches were large (8 alive each), decoding was worth more than the switch
    assert max(sizes) >= 6


def test_finished_ratio_ablation():
    sched = _scheduler(num_blocks=64, depth=1, intensity_switch=False, finished_ratio=0.5)
    sched.step_times = None                                  # the ablation needs no table
    for i in range(4):                                       # finish after 2, 3, 4, 5 tokens
        sched.add(_seq(i, 16, 2 + i, predicted=100))
    late = _seq(9, 16, 5)
    launched = _drive(sched, 1, late=late)
    assert launched[-1].items[0].seq is late
    switch = [d for d in sched.drain_decisions() if d["switch"] == "decode->prefill"]
    assert switch[0]["reason"] == "finished ratio reached"
    assert switch[0]["finished_ratio"] == 0.5                # 2 of the 4 done, not before
    assert switch[0]["running"] == 2


def test_work_stealing_rebalances_a_batch_emptied_by_finishes():
    """The first decode batch holds the short requests, the second the long ones: with stealing
    the long batch gives half its requests away once the short ones are gone; without, one
    pipeline slot runs everything and the other idles."""
    sizes = {}
    for enabled in (True, False):
        sched = _scheduler(num_blocks=128, depth=2, work_stealing=enabled)
        for i in range(16):
            sched.add(_seq(i, 16, 3 if i < 8 else 30, predicted=30))
        launched = _drive(sched, 2, stop_on_prefill=False)
        decode = [len(b) for b in launched if b.phase == "decode"]
        sizes[enabled] = decode
        assert sched.block_manager.num_free_blocks == 128 and not sched.running
    late_on, late_off = sizes[True][-10:], sizes[False][-10:]
    assert max(late_on) - min(late_on) <= 1, sizes[True]
    assert max(late_off) - min(late_off) >= 3, sizes[False]        # 6 and 2, forever


def test_decode_preemption_never_evicts_a_reserved_member():
    """A full cache during decode: the batch preempts idle requests, then its own last members,
    and every request it launches holds KV blocks for its next token."""
    sched = _scheduler(num_blocks=10, depth=1)
    for i in range(5):                      # 5 x (16-token prompt + 30 tokens) = 230 > 160
        sched.add(_seq(i, 16, 30, predicted=1))
    launched = _drive(sched, 1, stop_on_prefill=False, max_steps=400)
    assert sched.num_preemptions > 0
    for batch in launched:
        if batch.phase == "decode":
            assert all(item.num_tokens == 1 for item in batch.items)
    done = {id(item.seq) for b in launched for item in b.items}
    assert len(done) == 5 and not sched.running and not sched.waiting
    sched.block_manager.check_invariants()


def test_swapped_requests_come_back_in_decode_without_recomputing():
    """memory.preemption_mode swap: the same full cache swaps requests out and brings them back
    when the forecast leaves room; no prompt is computed twice and nothing new is admitted
    while one waits in the swap area."""
    from batchinfer.engine.kv_swap import SwapSpace

    sched = _scheduler(num_blocks=10, depth=1)
    sched.block_manager.swap = SwapSpace(64, 16)
    for i in range(5):
        sched.add(_seq(i, 16, 30, predicted=1))
    launched = _drive(sched, 1, stop_on_prefill=False, max_steps=400)
    swap = sched.block_manager.swap
    assert sched.num_preemptions > 0 and swap.num_swap_outs == sched.num_preemptions
    assert swap.num_swap_ins == swap.num_swap_outs
    assert sum(b.num_tokens for b in launched if b.phase == "prefill") == 5 * 16
    done = {id(item.seq) for b in launched for item in b.items}
    assert len(done) == 5 and not sched.has_unfinished()
    assert swap.store.num_free_blocks == 64
    sched.block_manager.check_invariants()


@pytest.mark.parametrize("depth,greedy", [(2, True), (2, False), (3, False)])
def test_swapping_under_wrong_forecasts_never_launches_a_request_twice_or_without_kv(depth,
                                                                                     greedy):
    """Pipelined decode batches, work stealing, forecasts off by up to 4x: a request swapped out
    while it waits in the stealing pool or in a returned batch, then brought back, is never
    launched twice at once nor while swapped."""
    import random

    from batchinfer.engine.kv_swap import SwapSpace

    for seed in range(12):
        rng = random.Random(seed)
        sched = _scheduler(num_blocks=14, depth=depth, greedy_prefill=greedy)
        sched.block_manager.swap = SwapSpace(256, 16)
        for i in range(12):
            out = rng.randint(4, 60)
            sched.add(_seq(i, rng.randint(8, 40), out, predicted=max(1, out // rng.randint(1, 4))))
        in_flight, prefill_tokens = [], 0
        for _ in range(3000):
            while len(in_flight) < sched.in_flight_limit(depth):
                batches = sched.schedule()
                if not batches:
                    break
                for batch in batches:
                    ids = [id(item.seq) for item in batch.items]
                    assert len(ids) == len(set(ids)), seed
                    for item in batch.items:
                        assert item.seq.status is SequenceStatus.RUNNING and not item.seq.in_flight
                        assert sched.block_manager.block_table(item.seq.request_id), seed
                        item.seq.in_flight = True
                    prefill_tokens += batch.num_prefill_tokens
                    in_flight.append(batch)
            if not in_flight:
                break
            _complete(sched, in_flight.pop(0))
        assert not sched.has_unfinished(), seed
        swap = sched.block_manager.swap
        assert swap.num_swap_ins == swap.num_swap_outs and swap.store.num_free_blocks == 256
        sched.block_manager.check_invariants()


# --- recipe and step-time table ------------------------------------------------------------------------
def test_recipe_validates_tdpipe_parameters():
    recipe = parse_recipe({"strategy": {"name": "tdpipe", "work_stealing": False},
                           "parallel": {"pp": 2}})
    assert recipe.engine_config().strategy.work_stealing is False
    with pytest.raises(RecipeError, match="strategy.kv_safty_ratio"):
        parse_recipe({"strategy": {"name": "tdpipe", "kv_safty_ratio": 0.9}})


def test_step_times_round_trip_and_bad_file(tmp_path):
    path = tmp_path / "times.json"
    TABLE.save(path)
    loaded = StepTimes.load(path)
    assert loaded.decode == TABLE.decode and loaded.prefill_time(640) == pytest.approx(0.25)
    (tmp_path / "bad.json").write_text(json.dumps({"decode": []}))
    with pytest.raises(ConfigError, match="bad.json"):
        StepTimes.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="times > 0"):
        StepTimes([(1, 0.0)], [(64, 0.1)])
    with pytest.raises(ValueError, match="distinct"):
        StepTimes([(1, 0.1), (1, 0.2)], [(64, 0.1)])


# --- on the real engine --------------------------------------------------------------------------------


@pytest.mark.slow
def test_pp2_tdpipe_equals_the_baseline_under_memory_pressure():
    """16 requests that need ~3x the KV cache: TD-Pipe alternates phases several times on two
    pipeline stages and still produces the single-process baseline's greedy tokens."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine

    reference = [list(tokens) for tokens in tight_reference()]
    assert_context_dependent(reference)
    # the step times are profiled at startup on the two workers, before any request
    config = EngineConfig(**TIGHT, parallel={"pp": 2}, strategy=TDPipeParams(
        max_num_batched_tokens=64, profile_decode_batch_sizes=[1, 8],
        profile_prefill_tokens=[32, 64], profile_context_len=16))
    with Engine.from_config(config) as engine:
        assert engine.info["step_times"]["meta"]["pipeline_depth"] == 2
        outs = engine.generate(E2E_PROMPTS, E2E_PARAMS)
        sched = engine.scheduler
        events = engine.drain_step_events()
        assert engine.info["strategy"] == "tdpipe"
    assert [o.output_token_ids for o in outs] == reference
    assert isinstance(sched, TDPipeScheduler) and sched.num_switches >= 3
    assert {e["phase"] for e in events} == {"prefill", "decode"}        # never a mixed batch
    decisions = [d for e in events for d in e.get("decisions", ())]
    assert {d["switch"] for d in decisions} == {"prefill->decode", "decode->prefill"}
    assert any("kv_predicted" in e for e in events if e["phase"] == "decode")
    sched.block_manager.check_invariants()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


@pytest.mark.slow
def test_pp2_tdpipe_swapping_gives_the_baseline_tokens():
    """The same job with memory.preemption_mode swap: each stage copies its layers' KV of a
    preempted request out and back, and no prompt is prefilled twice."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine

    reference = [list(tokens) for tokens in tight_reference()]
    cache = {**TIGHT["cache"], "preemption_mode": "swap", "swap_space": "32MiB"}
    config = EngineConfig(model=TIGHT["model"], cache=cache, parallel={"pp": 2},
                          strategy=TDPipeParams(max_num_batched_tokens=64,
                                                profile_decode_batch_sizes=[1, 8],
                                                profile_prefill_tokens=[32, 64],
                                                profile_context_len=16))
    with Engine.from_config(config) as engine:
        outs = engine.generate(E2E_PROMPTS, E2E_PARAMS)
        stats = engine.stats()
        prompt_tokens = sum(len(engine.tokenizer.encode(p)) for p in E2E_PROMPTS)
        engine.scheduler.block_manager.check_invariants()
    assert [o.output_token_ids for o in outs] == reference
    assert stats["kv_swap"]["swap_outs"] == stats["num_preemptions"] > 0
    assert stats["computed_prefill_tokens"] <= prompt_tokens


@pytest.mark.slow
def test_startup_profile_times_real_micro_batches_and_leaves_no_trace(make_engine):
    from batchinfer.engine.step_times import profile_step_times

    with make_engine(**TIGHT) as engine:
        table = profile_step_times(engine, [1, 4, 256], [16, 48], context_len=16, prompt_len=32)
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks                 # every synthetic block back
        # 256 x 17 tokens do not fit in 227: that micro-batch's sequences share their blocks
        assert [b for b, _ in table.decode] == [1, 4, 256] and table.meta["shared_blocks"]
        assert [n for n, _ in table.prefill] == [16, 48]
        assert all(t > 0 for _, t in table.decode + table.prefill)
        out = engine.generate(E2E_PROMPTS[:2], E2E_PARAMS[:2])
        assert [len(o.output_token_ids) for o in out] == [12, 25]


@pytest.mark.slow
def test_tdpipe_recipe_runs_out_of_the_box(tmp_path):
    """recipes/tdpipe.yaml as shipped, on the embedded default, through `batchinfer run`."""
    out = tmp_path / "run"
    _, report = run_shipped_recipe("tdpipe", out, limit=3)
    events = report["session"]["strategy_decisions"]["events"]
    assert events and events[0]["switch"] == "prefill->decode"
    table = StepTimes.from_json(report["engine"]["step_times"])    # reusable as step_times:
    assert [b for b, _ in table.decode] == [1, 8, 32, 64, 128, 256]
    assert "## Strategy decisions" in (out / "report.md").read_text()


@pytest.mark.slow
def test_a_cache_under_the_profiled_shapes_times_shorter_sequences(make_engine, caplog):
    """At PP=2 two prefill micro-batches are in flight at once; a cache under two prompts of the
    profiled length (a small job's, which the job itself fits) times prompts halved in length
    until they fit, with a warning that says so, rather than refusing the job."""
    from batchinfer.engine.step_times import profile_step_times

    model = {"load_format": "dummy", "max_model_len": 128, "dtype": "float32",
             "hf_overrides": {"num_hidden_layers": 2}}
    # SmolLM2's 3 KV heads of 64, fp32, 1 layer a stage: 1,536 bytes a token: ~170 tokens
    with make_engine(model=model, cache={"kv_cache_memory": 1536 * 176},
                     parallel={"pp": 2}) as engine:
        with caplog.at_level("WARNING", logger="batchinfer"):
            table = profile_step_times(engine, [1], [128], context_len=16, prompt_len=128)
    shorter = table.meta["prompt_len"]
    assert [n for n, _ in table.prefill] == [128] and shorter in (64, 32, 16)
    assert table.meta["context_len"] == 16 and [b for b, _ in table.decode] == [1]
    assert (f"timed decode at 16 tokens of context and prompts of {shorter} tokens instead"
            in caplog.text)
