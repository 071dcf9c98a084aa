"""Profiled micro-batch times: decode step time vs batch size, prefill time vs token count.

Strategies that weigh one schedule against another (a spatial-temporal intensity, a
simulator) read these tables instead of guessing. `profile_step_times` measures them on the
engine's own executor at startup: synthetic sequences get real KV blocks, the executor is kept
full (`max_in_flight` micro-batches, so a pipeline is measured in its steady state) and the
median interval between completed micro-batches is the time of one micro-batch. A table can be
saved as JSON and loaded instead of measuring again.
"""
from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from itertools import cycle
from pathlib import Path
from typing import Union

from .errors import ConfigError
from .request import Request, SamplingParams, Sequence, SequenceStatus
from .scheduler import MicroBatch, ScheduledSeq

log = logging.getLogger("batchinfer")


def interpolate(table: list[tuple[int, float]], x: float) -> float:
    """Piecewise linear through the points (sorted by x). Extrapolation rules: below the first
    point, its time (a smaller micro-batch is not faster than the smallest one timed); above the
    last point, the last segment's slope, never negative (a one-point table: proportional to x)."""
    if len(table) == 1 or x <= table[0][0]:
        return table[0][1] if x <= table[0][0] else table[0][1] * x / table[0][0]
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = table[-2], table[-1]
    return y1 + max(y1 - y0, 0.0) * (x - x1) / (x1 - x0)


@dataclass
class StepTimes:
    """Seconds per micro-batch (one pipeline slot in steady state)."""

    decode: list[tuple[int, float]]          # (batch size, seconds), batch size ascending
    prefill: list[tuple[int, float]]         # (prompt tokens in the micro-batch, seconds)
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.decode = sorted((int(b), float(t)) for b, t in self.decode)
        self.prefill = sorted((int(n), float(t)) for n, t in self.prefill)
        if not self.decode or not self.prefill:
            raise ValueError("a step-time table needs at least one decode and one prefill point")
        for name, table in (("decode", self.decode), ("prefill", self.prefill)):
            sizes = [x for x, _ in table]
            if min(sizes) < 1 or min(t for _, t in table) <= 0 or len(set(sizes)) != len(sizes):
                raise ValueError(f"{name}: sizes must be distinct and >= 1, times > 0")

    def decode_time(self, batch_size: int) -> float:
        return interpolate(self.decode, max(batch_size, 1))

    def prefill_time(self, num_tokens: int) -> float:
        return interpolate(self.prefill, max(num_tokens, 1))

    def peak_decode_rate(self) -> float:
        """Requests advanced per second at the best measured batch size (arXiv:2506.10470's Peak)."""
        return max(b / t for b, t in self.decode)

    def to_json(self) -> dict:
        return {"decode": [list(p) for p in self.decode], "prefill": [list(p) for p in self.prefill],
                "meta": self.meta}

    @classmethod
    def from_json(cls, data: dict) -> "StepTimes":
        return cls([tuple(p) for p in data["decode"]], [tuple(p) for p in data["prefill"]],
                   dict(data.get("meta", {})))

    @classmethod
    def load(cls, path: Union[str, Path]) -> "StepTimes":
        """A table saved by `save` (or the `step_times` object of a report)."""
        try:
            data = json.loads(Path(path).read_text())
            if "step_times" in data and "decode" not in data:
                data = data["step_times"]
            return cls.from_json(data)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: not a step-time table ({exc}); expected JSON with "
                              "'decode' and 'prefill' lists of [size, seconds]") from exc

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))


# --- measuring -------------------------------------------------------------------------------------
class SyntheticSequences:
    """Sequences that exist only to be timed: real blocks, never scheduled, released after."""

    def __init__(self, engine, vocab_size: int):
        rep = engine.replicas[0]
        self.executor, self.block_manager = rep.executor, rep.scheduler.block_manager
        self.vocab = max(vocab_size, 2)
        self.seqs: list[Sequence] = []
        self.shared = False

    def make(self, prompt_len: int, decode: bool) -> Sequence:
        rid = f"__step-profile-{len(self.seqs)}"
        tokens = [1 + (len(self.seqs) * 31 + i) % (self.vocab - 1) for i in range(prompt_len)]
        seq = Sequence(Request(rid, tokens, SamplingParams(max_tokens=1 << 20, temperature=0.0,
                                                           ignore_eos=True)))
        seq.status = SequenceStatus.RUNNING
        if decode:
            seq.output_token_ids.append(tokens[-1])
            seq.num_computed_tokens = prompt_len
        self.seqs.append(seq)
        return seq

    def fits(self, num_seqs: int, tokens_each: int) -> bool:
        bm = self.block_manager
        need = num_seqs * bm.num_groups * -(-tokens_each // bm.block_size)
        return need <= bm.num_free_blocks

    def allocate(self, seqs: list[Sequence], tokens: int) -> bool:
        """Own blocks for each sequence when they fit, else one set shared by all of them (the
        attention then reads the same blocks, the GEMMs are the same). False if not even that."""
        if not self.fits(1, tokens):
            return False
        if self.fits(len(seqs), tokens):
            for seq in seqs:
                self.block_manager.grow(seq.request_id, tokens)
            return True
        donor = seqs[0]
        self.block_manager.grow(donor.request_id, tokens)
        for seq in seqs[1:]:
            self.block_manager.share_tables(seq.request_id, donor.request_id)
        self.shared = True
        return True

    def release(self) -> None:
        for seq in self.seqs:
            self.executor.release(seq.request_id)
            self.block_manager.free(seq.request_id)
        self.seqs.clear()


def _steady_interval(executor, batches: list[MicroBatch], rounds: int, clock) -> float:
    """Keeps the executor full with the batches in turn; the median time between completions
    after the first round (warm-up, pipeline fill) is one micro-batch's steady-state time.
    clock: the engine's (wall time, or the simulator's virtual time)."""
    total = len(batches) * (rounds + 1)
    feed = cycle(batches)
    submitted, stamps = 0, []
    while len(stamps) < total:
        while executor.num_in_flight < executor.max_in_flight and submitted < total:
            executor.submit(next(feed))
            submitted += 1
        while not executor.ready():
            executor.wait()
        executor.collect()
        stamps.append(clock())
    skip = len(batches)
    intervals = [b - a for a, b in zip(stamps[skip - 1:], stamps[skip:])]
    return statistics.median(intervals)


def profile_step_times(engine, decode_batch_sizes: list[int], prefill_tokens: list[int],
                       context_len: int = 128, prompt_len: int = 256, rounds: int = 2,
                       keys: tuple[str, str] = ("the decode batch sizes", "the prefill token "
                                                "counts")) -> StepTimes:
    """Times decode micro-batches of each size (every sequence at `context_len` tokens of KV) and
    prefill micro-batches of each token count (prompts of `prompt_len` tokens) on replica 0.
    When the free KV blocks cannot hold every sequence, a micro-batch's sequences share one set
    of blocks; a size that does not fit even so is skipped (logged). Where no size fits (a small
    job's cache), the sequences are halved in length until one does (a warning says so). keys:
    the settings that give the decode sizes and the prefill token counts, for the error when
    none fits at any length."""
    if engine.has_unfinished():
        raise RuntimeError("profile the step times before submitting requests")
    if min(decode_batch_sizes) < 1 or min(prefill_tokens) < 1:
        raise ConfigError("profiled batch sizes and token counts must be at least 1")
    # positions stay inside the model's rotary table
    prompt_len = max(1, min(prompt_len, engine.max_model_len))
    context_len = max(1, min(context_len, engine.max_model_len - 1))
    asked = (context_len, prompt_len)
    synth = SyntheticSequences(engine, int(engine.info.get("vocab_size") or 2))
    executor = synth.executor
    depth = executor.max_in_flight
    t0 = time.perf_counter()

    def timed(lengths: list[int], kv_tokens: int, phase: str):
        """The steady interval of `depth` micro-batches of sequences of `lengths` tokens (KV
        up to kv_tokens each), or None where the free blocks cannot hold them."""
        batches = []
        try:
            for _ in range(depth):
                seqs = [synth.make(n, decode=phase == "decode") for n in lengths]
                if not synth.allocate(seqs, kv_tokens):
                    return None
                batches.append(MicroBatch([ScheduledSeq(s, 1 if phase == "decode"
                                                        else s.prompt_len) for s in seqs],
                                          phase=phase))
            return _steady_interval(executor, batches, rounds, engine.now)
        finally:
            synth.release()

    def decode_points(ctx: int) -> list[tuple[int, float]]:
        points = []
        for size in sorted(set(decode_batch_sizes)):
            seconds = timed([ctx] * size, ctx + 1, "decode")
            if seconds is not None:
                points.append((size, seconds))
            elif ctx == asked[0]:        # (at shorter lengths: one warning at the end)
                log.info("step profile: decode batch %d skipped (KV cache too small)", size)
        return points

    def prefill_points(plen: int) -> list[tuple[int, float]]:
        points = []
        for tokens in sorted(set(prefill_tokens)):
            lengths = [plen] * (tokens // plen) + ([tokens % plen] if tokens % plen else [])
            seconds = timed(lengths, max(lengths), "prefill")
            if seconds is not None:
                points.append((tokens, seconds))
            elif plen == asked[1]:
                log.info("step profile: prefill of %d tokens skipped (KV cache too small)", tokens)
        return points

    try:
        decode, prefill = decode_points(context_len), prefill_points(prompt_len)
        # a cache too small for the profiled shapes (a small job's): shorter sequences, said
        while not decode and context_len > 1:
            context_len //= 2
            decode = decode_points(context_len)
        while not prefill and prompt_len > 1:
            prompt_len //= 2
            prefill = prefill_points(prompt_len)
    finally:
        synth.release()
        reset = getattr(executor, "reset_timeline", None)
        if reset is not None:     # the report's bubble ratios are about the job, not the profile
            reset()
    if not decode or not prefill:
        kind, key, smallest = (("decode batch", keys[0], f"{min(decode_batch_sizes)} sequence(s) "
                                "of any length") if not decode else
                               ("prefill micro-batch", keys[1], f"{min(prefill_tokens)} tokens "
                                "in prompts of any length"))
        per_replica = engine.stats().get("kv_capacity_tokens", 0) // len(engine.replicas)
        raise ConfigError(
            f"{key}: the KV cache ({per_replica} tokens a replica) cannot hold even the smallest "
            f"profiled {kind} ({smallest}, {depth} in flight at once); lower {key} or raise "
            "memory.kv_cache_memory")
    if context_len < asked[0] or prompt_len < asked[1]:
        log.warning("step profile: the KV cache (%d tokens a replica) holds no micro-batch of "
                    "the profiled shapes; timed decode at %d tokens of context and prompts of %d "
                    "tokens instead (asked: %d and %d)",
                    engine.stats().get("kv_capacity_tokens", 0) // len(engine.replicas),
                    context_len, prompt_len, *asked)
    table = StepTimes(decode, prefill, {"context_len": context_len, "prompt_len": prompt_len,
                                        "pipeline_depth": depth, "rounds": rounds,
                                        "shared_blocks": synth.shared,
                                        "seconds": round(time.perf_counter() - t0, 2)})
    log.info("step profile (%.1f s): decode %s; prefill %s", table.meta["seconds"],
             ", ".join(f"{b}: {t * 1e3:.1f} ms" for b, t in table.decode),
             ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in table.prefill))
    return table
