"""TD-Pipe's three decisions as pure functions over plain numbers (arXiv:2506.10470).

- `KVForecast` (§3.3, Algorithm 1, AI-based greedy prefill): predicted KV usage at future decode
  points; prefill -> decode when its peak exceeds the capacity.
- `WorkStealing` (§3.4, Fig. 9, inter-batch work stealing): a sliding window of the last PP decode
  batch sizes; a returning batch above the window average leaves its excess in a withheld pool,
  one below it is topped up from the pool.
- `spatial_intensity` / `temporal_intensity` (§3.5, eqs. 1 and 2): decode -> prefill when the
  decode phase's efficiency (achieved / peak per-request decode rate) drops below the share of the
  next prefill cycle that is not bubble.

Nothing here knows about sequences or the engine: the scheduler (strategies/tdpipe/scheduler.py) feeds them
numbers, and unit tests drive them with the paper's own examples.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass
from typing import Generic, Optional, Sequence, TypeVar

from batchinfer.engine.step_times import StepTimes

T = TypeVar("T")


def future_points(interval: int = 32, horizon: int = 1024) -> list[int]:
    """The decode steps at which future KV usage is checked: 32, 64, ..., 1024 by default."""
    if interval < 1 or horizon < interval:
        raise ValueError("future points need 1 <= interval <= horizon")
    return list(range(interval, horizon + 1, interval))


def forecast_length(request, params) -> Optional[int]:
    """Algorithm 1's getPredictLen: the predictor's point forecast, or with
    `unsure_upper_forecast` its upper one (the predictor's upper_percentile) when the predictor's
    confidence in it is below `unsure_confidence`: a request whose forecast may well be too
    short is planned for longer, so a poor forecast costs fewer preemptions. None: no forecast."""
    point = request.predicted_output_len
    if point is None or not params.unsure_upper_forecast:
        return point
    upper, confidence = request.predicted_output_upper, request.predicted_confidence
    if upper is None or confidence is None or confidence >= params.unsure_confidence:
        return point
    return max(point, upper)


class KVForecast:
    """Algorithm 1's kvUsage map: predicted KV tokens held at each future decode point.

    Stored as, per number of points a request stays for, the count of such requests and the sum
    of their input lengths, so an update costs O(log points) and a read O(points).

    A paged cache holds whole blocks: a request of L tokens takes ceil(L / block_size) of them.
    Each input is rounded up to a block, so where the block size divides the point interval (16
    and 32 by default) the usage is exactly what the cache will hold, not up to a block per
    request less (which, summed over a phase's requests, let the prefill overshoot into
    preemptions).

    Sliding windows (`windows`: one entry per block table a sequence has, 0 for a table that
    keeps the whole context; (0,) for a plain model): a table whose layers see only their last
    w keys releases the blocks behind the window, so past ceil(w / block_size) + 1 blocks it holds
    no more (kv_groups.blocks_per_sequence for a decoding sequence). Usage is then in pool
    tokens (blocks x block_size over every table): Gemma's windowed groups count their few
    blocks, not the context, and a model windowed on every layer its window.

    Read literally, Algorithm 1 sees a request only at the points it outlives: one predicted to
    end before the first point (32 steps) adds nothing, though it holds its KV until then, so a
    job of short replies prefills until the cache is physically full and its decode phase starts
    preempting. With `count_ending` each request also counts, at the first point after its end,
    what it holds when it ends (input + its length): the check then bounds the peak between two
    points, not only at them, up to the horizon (a request predicted past the last point counts
    as input + that point, as in the paper)."""

    def __init__(self, points: Sequence[int], capacity_tokens: float, block_size: int = 1,
                 count_ending: bool = False, windows: Sequence[int] = (0,)):
        self.points = list(points)
        self.capacity = float(capacity_tokens)
        self.block_size = max(int(block_size), 1)
        self.count_ending = count_ending
        self.windows = tuple(int(w) for w in windows) or (0,)
        self._whole_tables = sum(1 for w in self.windows if not w)
        # the most pool tokens a decoding sequence holds in each windowed table
        self._caps = [(-(-w // self.block_size) + 1) * self.block_size
                      for w in self.windows if w]
        self._count = [0] * len(self.points)
        self._input = [0] * len(self.points)
        self._held = [0] * len(self.points)      # windowed tables at their cap: constant tokens
        self._ending = [0] * len(self.points)

    def copy(self) -> "KVForecast":
        other = KVForecast(self.points, self.capacity, self.block_size, self.count_ending,
                           self.windows)
        other._count, other._input = list(self._count), list(self._input)
        other._held, other._ending = list(self._held), list(self._ending)
        return other

    def holds(self, tokens: int) -> int:
        """Pool tokens a decoding sequence of `tokens` tokens holds over its tables."""
        whole = -(-tokens // self.block_size) * self.block_size
        return self._whole_tables * whole + sum(min(whole, cap) for cap in self._caps)

    def update(self, input_len: int, predict_len: int) -> None:
        """UpdateUsage: a request holding `input_len` tokens that will generate `predict_len` more
        adds input_len (in whole blocks) + point at every future point up to its predicted
        length (a windowed table no more than its cap); with count_ending, also what it holds
        at input_len + predict_len at the first point after its end."""
        reach = bisect_right(self.points, predict_len)
        rounded = -(-input_len // self.block_size) * self.block_size
        if reach:
            self._grow(reach, rounded, self._whole_tables)
            for cap in self._caps:
                # points where input + point stays under the cap grow, the rest hold the cap
                under = min(bisect_left(self.points, cap - rounded), reach)
                self._grow(under, rounded, 1)
                if under < reach:
                    self._held[reach - 1] += cap
                    if under:
                        self._held[under - 1] -= cap
        ends_between = reach < len(self.points) and (
            not reach or self.points[reach - 1] != predict_len)
        if self.count_ending and ends_between:
            self._ending[reach] += self.holds(input_len + predict_len)

    def _grow(self, end: int, rounded: int, tables: int) -> None:
        """`tables` tables of a request holding `rounded` tokens + the point at points [0, end)
        (the map is summed from the last point down)."""
        if end and tables:
            self._count[end - 1] += tables
            self._input[end - 1] += tables * rounded

    @property
    def usage(self) -> list[int]:
        out = [0] * len(self.points)
        count = total = held = 0
        for index in range(len(self.points) - 1, -1, -1):
            count += self._count[index]
            total += self._input[index]
            held += self._held[index]
            out[index] = total + count * self.points[index] + held + self._ending[index]
        return out

    def peak(self) -> int:
        return max(self.usage, default=0)

    def fits(self, input_len: int, predict_len: int) -> bool:
        """Would the predicted peak stay within the capacity with this request added?"""
        trial = self.copy()
        trial.update(input_len, predict_len)
        return not trial.should_switch()

    def should_switch(self) -> bool:
        """CheckSwitch: some future point needs more KV than there is."""
        return self.peak() > self.capacity

    def at_step(self, step: int) -> int:
        """Predicted usage `step` decode steps after the forecast began (the next point's)."""
        index = bisect_left(self.points, step)
        return self.usage[index] if index < len(self.points) else 0


class WorkStealing(Generic[T]):
    """Inter-batch work stealing over `depth` decode batches in flight.

    The window holds the sizes of the last `depth` submitted batches; the withheld pool holds
    requests taken out of oversized batches (and, at the start of a decode phase, every request
    not yet in a batch). When a batch returns with `finished` requests done, the average is
    (sum(window) + |pool| - finished) / depth; the batch keeps at most ceil(average) requests and
    one below it takes requests from the pool up to that. With `enabled` off (the paper's
    ablation) a batch never gives requests away; the pool (new requests only) still tops batches
    up, so the initial split stays even.
    """

    def __init__(self, depth: int, enabled: bool = True):
        self.depth = depth
        self.enabled = enabled
        self.window: deque[int] = deque([0] * depth, maxlen=depth)
        self.pool: list[T] = []
        self.last_average: Optional[float] = None

    def reset(self) -> None:
        self.window = deque([0] * self.depth, maxlen=self.depth)
        self.pool = []

    def average(self, finished: int) -> float:
        return (sum(self.window) + len(self.pool) - finished) / self.depth

    def next_batch(self, members: list[T], finished: int) -> list[T]:
        """The batch to submit after one came back with `members` still running and `finished`
        done (an empty `members` forms a new batch from the pool)."""
        average = self.average(finished)
        self.last_average = average
        target = max(math.ceil(average - 1e-9), 0)
        batch = list(members)
        if self.enabled and len(batch) > target:
            self.pool.extend(batch[target:])
            batch = batch[:target]
        elif len(batch) < target and self.pool:
            take = target - len(batch)
            batch.extend(self.pool[:take])
            del self.pool[:take]
        self.window.append(len(batch))
        return batch


@dataclass
class Intensities:
    spatial: float
    temporal: float
    bubble_s: float
    total_s: float
    decode_s: float

    @property
    def switch(self) -> bool:
        return self.spatial < self.temporal


def spatial_intensity(times: StepTimes, batch_size: int) -> float:
    """Eq. 1: Achieved / Peak, per-request decode rates (batch size / step time)."""
    if batch_size <= 0:
        return 0.0
    achieved = batch_size / times.decode_time(batch_size)
    return achieved / times.peak_decode_rate()


def temporal_intensity(times: StepTimes, prefill_batches: Sequence[int], decode_batch_size: int,
                       depth: int) -> tuple[float, float, float]:
    """Eq. 2: 1 - bubble / total for switching to prefill now. bubble: the longest pending
    prefill micro-batch minus the current decode step; total: all pending prefills + one decode
    step per batch + the bubble. -> (intensity, bubble seconds, total seconds); 0 when nothing
    would be prefilled."""
    if not prefill_batches:
        return 0.0, 0.0, 0.0
    decode_s = times.decode_time(decode_batch_size) if decode_batch_size > 0 else 0.0
    prefill_s = [times.prefill_time(n) for n in prefill_batches]
    bubble = max(max(prefill_s) - decode_s, 0.0)
    total = sum(prefill_s) + depth * decode_s + bubble
    return (1.0 - bubble / total if total > 0 else 0.0), bubble, total


def intensities(times: StepTimes, decode_batch_size: int, prefill_batches: Sequence[int],
                depth: int) -> Intensities:
    temporal, bubble, total = temporal_intensity(times, prefill_batches, decode_batch_size, depth)
    decode_s = times.decode_time(decode_batch_size) if decode_batch_size > 0 else 0.0
    return Intensities(spatial_intensity(times, decode_batch_size), temporal, bubble, total,
                       decode_s)


def pack_prefill(prompt_lens: Sequence[int], token_budget: int) -> list[int]:
    """Whole prompts into micro-batches of at most `token_budget` tokens (a longer prompt goes
    alone), in order -> token count of each micro-batch."""
    batches: list[int] = []
    current = 0
    for n in prompt_lens:
        if current and current + n > token_budget:
            batches.append(current)
            current = 0
        current += n
    if current:
        batches.append(current)
    return batches
