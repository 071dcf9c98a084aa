"""Counters and timelines of one run session: what report.json, metrics.jsonl and the plots show.

Fed by the job loop with the engine's per-step events and each finished request; memory stays
bounded on any job size and length (latencies are a fixed-size uniform reservoir, batch sizes a
histogram, the plots' timeline at most timeline.MAX_POINTS points; metrics.jsonl gets every
sample).
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .micro_batch_tokens import DEFINITION as MICRO_BATCH_DEFINITION
from .micro_batch_tokens import MicroBatchTokens
from .timeline import BoundedTimeline
from batchinfer.engine.request import RequestOutput

RESERVOIR = 100_000
MAX_DECISIONS = 200

DEFINITIONS = {
    "generation_s": "wall time from the first request handed to the engine to the last result "
                    "written (or now, while running); model loading is excluded",
    "requests_per_s": "requests completed in this session / generation_s (failed ones excluded)",
    "input_tokens_per_s": "prompt tokens of the completed requests / generation_s",
    "output_tokens_per_s": "generated tokens of the completed requests / generation_s (requests "
                           "answered from an identical request's result count their reply too)",
    "computed_output_tokens_per_s": "output tokens the engine generated / generation_s: "
                                    "output_tokens_per_s without the replies copied to "
                                    "duplicates (io.dedup); present when there were any",
    "total_tokens_per_s": "(prompt + generated tokens of the completed requests) / generation_s",
    "latency_s.e2e": "per request: from admission to the engine to its last token",
    "latency_s.ttft": "per request: from admission to the engine to its first generated token",
    "latency_s.tpot": "per request: (e2e - ttft) / (generated tokens - 1), time per output token",
    "kv.usage": "share of KV cache blocks in use, per engine step (time-weighted mean, max)",
    "phases_s": "wall time spent per phase: model load, reading+tokenizing input, output-length "
                "prediction, engine steps by batch phase, writing results, rendering reports",
    "predictor": "the output-length predictor's inference: requests, batches, seconds and share "
                 "of the job's elapsed time",
    "micro_batch_tokens": MICRO_BATCH_DEFINITION,
    "requests_by_lora": "requests completed in this session per LoRA adapter (a line's lora, an "
                        "OpenAI line's body.model naming one); the rest ran the base model",
}


class Reservoir:
    """A uniform sample of at most `size` values (Vitter's algorithm R), seeded for repeatability."""

    def __init__(self, size: int = RESERVOIR, seed: int = 0):
        self.size = size
        self.values: list[float] = []
        self.count = 0
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        self.count += 1
        if len(self.values) < self.size:
            self.values.append(value)
        else:
            slot = self._rng.randrange(self.count)
            if slot < self.size:
                self.values[slot] = value

    def summary(self) -> Optional[dict]:
        if not self.values:
            return None
        arr = np.asarray(self.values)
        p50, p90, p95, p99 = np.percentile(arr, [50, 90, 95, 99])
        return {"count": self.count, "mean": round(float(arr.mean()), 6),
                "p50": round(float(p50), 6), "p90": round(float(p90), 6),
                "p95": round(float(p95), 6), "p99": round(float(p99), 6),
                "max": round(float(arr.max()), 6)}


@dataclass
class _Bucket:
    steps: int = 0
    busy_s: float = 0.0
    seqs_sum: int = 0
    seqs_max: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    mb_tokens_min: Optional[int] = None
    mb_tokens_max: int = 0
    kv_usage_max: float = 0.0
    kv_usage_last: float = 0.0
    kv_predicted: Optional[float] = None   # the strategy's forecast for the last step
    kv_store: Optional[float] = None       # a second KV tier's occupancy (a CPU store)
    mode_steps: Counter = field(default_factory=Counter)  # steps per execution mode
    num_waiting: int = 0
    num_running: int = 0
    requests_done: int = 0
    requests_failed: int = 0
    phase_s: Counter = field(default_factory=Counter)
    expert_tokens: Optional[list[int]] = None   # a mixture of experts: tokens per expert


class SessionMetrics:
    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.completed = 0
        self.failed = 0
        self.lora_requests: Counter = Counter()     # adapter name -> requests completed with it
        self.error_codes: Counter = Counter()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.copied_completion_tokens = 0
        self.preempted_requests = 0
        self.e2e = Reservoir(seed=1)
        self.ttft = Reservoir(seed=2)
        self.tpot = Reservoir(seed=3)
        self.batch_sizes: Counter = Counter()
        self.micro_batch_tokens = MicroBatchTokens()
        self.step_phase_s: Counter = Counter()
        self.step_phase_count: Counter = Counter()
        self.phase_switches = 0
        self.decisions: list[dict] = []
        self.kv_weighted = 0.0
        self.kv_time = 0.0
        self.kv_max = 0.0
        self.phases_s: Counter = Counter()       # load / input / write / report (set by the job)
        self.first_admit_t: Optional[float] = None
        self.last_result_t: Optional[float] = None
        self.finished_t: Optional[float] = None      # set when the session stops generating
        self.timeline = BoundedTimeline()     # for the plots; samples go to metrics.jsonl
        self._bucket = _Bucket()
        self._bucket_start = 0.0
        self._last_phase: Optional[str] = None
        self._last_engine_counts = (0, 0)
        self._base_preemptions = 0

    # --- feeding ----------------------------------------------------------------------------------
    def start(self, engine_stats: dict, t: float) -> None:
        """Counts from here on (an engine may have served earlier jobs); `t`: the engine is ready."""
        self._bucket_start = t
        self._last_engine_counts = (int(engine_stats.get("generation_tokens", 0)),
                                    int(engine_stats.get("computed_prefill_tokens", 0)))
        self._base_preemptions = int(engine_stats.get("num_preemptions", 0))

    def on_admit(self, t: float) -> None:
        if self.first_admit_t is None:
            self.first_admit_t = t

    def on_steps(self, events: list[dict]) -> None:
        bucket = self._bucket
        for ev in events:
            dur = float(ev.get("dur", 0.0))
            phase = str(ev.get("phase", "mixed"))
            seqs = int(ev.get("num_seqs", 0))
            kv = float(ev.get("kv_usage", 0.0))
            bucket.steps += 1
            bucket.busy_s += dur
            bucket.seqs_sum += seqs
            bucket.seqs_max = max(bucket.seqs_max, seqs)
            prefill, decode = int(ev.get("num_prefill_tokens", 0)), int(ev.get("num_decode_tokens", 0))
            bucket.prefill_tokens += prefill
            bucket.decode_tokens += decode
            tokens = prefill + decode
            bucket.mb_tokens_max = max(bucket.mb_tokens_max, tokens)
            bucket.mb_tokens_min = tokens if bucket.mb_tokens_min is None else min(
                bucket.mb_tokens_min, tokens)
            self.micro_batch_tokens.add(prefill, decode, int(ev.get("replica", 0)))
            bucket.kv_usage_max = max(bucket.kv_usage_max, kv)
            bucket.kv_usage_last = kv
            bucket.num_waiting = int(ev.get("num_waiting", 0))
            bucket.num_running = int(ev.get("num_running", 0))
            bucket.phase_s[phase] += dur
            self.batch_sizes[seqs] += 1
            self.step_phase_s[phase] += dur
            self.step_phase_count[phase] += 1
            if self._last_phase is not None and phase != self._last_phase:
                self.phase_switches += 1
            self._last_phase = phase
            self.kv_weighted += kv * dur
            self.kv_time += dur
            self.kv_max = max(self.kv_max, kv)
            if ev.get("kv_predicted") is not None:
                bucket.kv_predicted = float(ev["kv_predicted"])
            if ev.get("kv_store_usage") is not None:
                bucket.kv_store = float(ev["kv_store_usage"])
            if ev.get("mode") is not None:
                bucket.mode_steps[ev["mode"]] += 1
            if ev.get("expert_tokens"):
                routed = ev["expert_tokens"]
                bucket.expert_tokens = (list(routed) if bucket.expert_tokens is None else
                                        [a + b for a, b in zip(bucket.expert_tokens, routed)])
            for decision in ev.get("decisions", ()):
                if len(self.decisions) < MAX_DECISIONS:
                    self.decisions.append({"t": ev.get("t"), **decision})

    def on_result(self, out: RequestOutput, t: float) -> None:
        self.completed += 1
        lora = getattr(out.payload, "lora", None)
        if lora is not None:
            self.lora_requests[lora] += 1
        self._bucket.requests_done += 1
        self.last_result_t = t
        self.prompt_tokens += out.num_prompt_tokens
        self.completion_tokens += out.num_output_tokens
        if out.copied_from is not None:            # delivered, not generated (io.dedup)
            self.copied_completion_tokens += out.num_output_tokens
        if out.num_preemptions:
            self.preempted_requests += 1
        if out.finish_time is not None:
            self.e2e.add(out.finish_time - out.arrival_time)
            if out.first_token_time is not None:
                self.ttft.add(out.first_token_time - out.arrival_time)
            # n samples (engine/parallel_sampling.py): each sample's own time per token
            for reply in getattr(out, "samples", None) or [out]:
                if reply.first_token_time is not None and reply.finish_time is not None \
                        and reply.num_output_tokens > 1:
                    self.tpot.add((reply.finish_time - reply.first_token_time)
                                  / (reply.num_output_tokens - 1))

    def on_error(self, code: str, t: float) -> None:
        self.failed += 1
        self.error_codes[code] += 1
        self._bucket.requests_failed += 1
        self.last_result_t = t

    def sample(self, t: float, engine_stats: Optional[dict], force: bool = False) -> Optional[dict]:
        """Closes the current timeline bucket if `interval_s` passed; returns it (for metrics.jsonl)."""
        dt = t - self._bucket_start
        if not force and dt < self.interval_s:
            return None
        if dt <= 0:
            return None
        b = self._bucket
        stats = engine_stats or {}
        gen, prefill = int(stats.get("generation_tokens", 0)), int(stats.get("computed_prefill_tokens", 0))
        d_gen = gen - self._last_engine_counts[0]
        d_prefill = prefill - self._last_engine_counts[1]
        self._last_engine_counts = (gen, prefill)
        sample = {
            "t": round(t, 3), "dt": round(dt, 3),
            "requests_done": b.requests_done, "requests_failed": b.requests_failed,
            "completed_total": self.completed, "failed_total": self.failed,
            "output_tokens_per_s": round(d_gen / dt, 2),
            "prefill_tokens_per_s": round(d_prefill / dt, 2),
            "steps": b.steps, "busy_s": round(b.busy_s, 4),
            "batch_size_mean": round(b.seqs_sum / b.steps, 2) if b.steps else 0.0,
            "batch_size_max": b.seqs_max,
            **({"mb_prefill_mean": round(b.prefill_tokens / b.steps, 2),
                "mb_decode_mean": round(b.decode_tokens / b.steps, 2),
                "mb_tokens_min": b.mb_tokens_min, "mb_tokens_max": b.mb_tokens_max}
               if b.steps else {}),
            "kv_usage": round(b.kv_usage_last, 4), "kv_usage_max": round(b.kv_usage_max, 4),
            **({"kv_predicted": round(b.kv_predicted, 4)} if b.kv_predicted is not None else {}),
            **({"kv_store_usage": round(b.kv_store, 4)} if b.kv_store is not None else {}),
            **({"mode_steps": dict(b.mode_steps)} if b.mode_steps else {}),
            **({"expert_tokens": b.expert_tokens} if b.expert_tokens is not None else {}),
            "num_waiting": b.num_waiting, "num_running": b.num_running,
            "preemptions_total": int(stats.get("num_preemptions", 0)) - self._base_preemptions,
            "phase_s": {k: round(v, 4) for k, v in b.phase_s.items()},
        }
        self.timeline.add(sample)
        self._bucket = _Bucket()
        self._bucket_start = t
        return sample

    # --- reading ----------------------------------------------------------------------------------
    def generation_s(self, now: float) -> float:
        if self.first_admit_t is None:
            return 0.0
        end = now if self.finished_t is None else self.finished_t
        return max(end - self.first_admit_t, 0.0)

    def summary(self, now: float, engine_stats: Optional[dict] = None) -> dict:
        gen_s = self.generation_s(now)
        rate = (lambda n: round(n / gen_s, 3) if gen_s > 0 else None)
        stats = engine_stats or {}
        preemptions = int(stats.get("num_preemptions", 0)) - self._base_preemptions
        sizes = self.batch_sizes
        steps = sum(sizes.values())
        return {
            "requests_completed": self.completed,
            "requests_failed": self.failed,
            "errors_by_code": dict(self.error_codes),
            # LoRA adapters: requests completed per adapter (the rest ran the base model)
            **({"requests_by_lora": dict(self.lora_requests)} if self.lora_requests else {}),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "generation_s": round(gen_s, 3),
            "throughput": {
                "requests_per_s": rate(self.completed),
                "input_tokens_per_s": rate(self.prompt_tokens),
                "output_tokens_per_s": rate(self.completion_tokens),
                "total_tokens_per_s": rate(self.prompt_tokens + self.completion_tokens),
                **({"computed_output_tokens_per_s":
                    rate(self.completion_tokens - self.copied_completion_tokens)}
                   if self.copied_completion_tokens else {}),
            },
            **({"copied_completion_tokens": self.copied_completion_tokens}
               if self.copied_completion_tokens else {}),
            "latency_s": {"e2e": self.e2e.summary(), "ttft": self.ttft.summary(),
                          "tpot": self.tpot.summary()},
            "preemptions": preemptions,
            "preempted_requests": self.preempted_requests,
            "kv": {
                "capacity_tokens": stats.get("kv_capacity_tokens"),
                "usage_mean": round(self.kv_weighted / self.kv_time, 4) if self.kv_time else None,
                "usage_max": round(self.kv_max, 4),
                "max_concurrency": stats.get("max_concurrency"),
                "window_freed_blocks": stats.get("kv_window_freed_blocks"),
            },
            "phases_s": {**{k: round(v, 3) for k, v in self.phases_s.items()},
                         **{f"engine_{k}": round(v, 3) for k, v in self.step_phase_s.items()}},
            "batch_size": {
                "steps": steps,
                "mean": round(sum(k * v for k, v in sizes.items()) / steps, 2) if steps else None,
                "max": max(sizes) if sizes else None,
                "histogram": {str(k): sizes[k] for k in sorted(sizes)},
            },
            "micro_batch_tokens": self.micro_batch_tokens.summary(),
            **({"pipeline": stats["pipeline"]} if stats.get("pipeline") else {}),
            "strategy_decisions": {
                "steps_by_phase": dict(self.step_phase_count),
                "phase_switches": self.phase_switches,
                "preemptions": preemptions,
                "events": list(self.decisions),
            },
        }


def predictor_summary(predictor, elapsed_s: float) -> dict:
    """report.json's session.predictor: the predictor's counters, its share of the job's time
    and (bert) its encoder's arithmetic."""
    pred = predictor.stats()
    pred["share_of_job"] = round(pred["seconds"] / elapsed_s, 6) if elapsed_s > 0 else None
    described = predictor.describe()
    for key in ("encoder", "oracle_field"):
        if described.get(key):
            pred[key] = described[key]
    return pred
