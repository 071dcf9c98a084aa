"""Drives a Scheduler by hand the way the engine does, without a model: launched micro-batches are
marked in flight, completed ones advance their sequences (one token sampled where a chunk reaches
the end) and go back to the scheduler. The strategies' unit tests drive their schedulers with it,
and benchmarks/strategies/tdpipe_replay.py replays TD-Pipe's decisions on real lengths."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from batchinfer.engine.engine import release_outside_windows
from batchinfer.engine.request import Request, SamplingParams, Sequence, SequenceStatus
from batchinfer.engine.scheduler import MicroBatch


def make_seq(i: int, prompt_len: int, max_tokens: int, predicted: Optional[int] = None) -> Sequence:
    request = Request(f"r{i}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens,
                                                                 ignore_eos=True))
    request.predicted_output_len = predicted
    return Sequence(request)


def launch(sched) -> list[MicroBatch]:
    batches = sched.schedule()
    for batch in batches:
        for item in batch.items:
            item.seq.in_flight = True
    return batches


def complete(sched, batch: MicroBatch) -> None:
    """What the engine does with a returned micro-batch."""
    for item in batch.items:
        seq = item.seq
        seq.in_flight = False
        seq.num_computed_tokens += item.num_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) >= seq.request.sampling.max_tokens:
                seq.status = SequenceStatus.FINISHED
    sched.on_result(batch)
    release_outside_windows(sched.block_manager, batch)


@dataclass
class Launched:
    """A micro-batch as it was when launched (token counts are only valid before completion)."""

    index: int
    prefill: int
    decode: int
    request_ids: list[str]
    kv_usage: float
    in_flight: int           # micro-batches in the pipeline with this one

    @property
    def tokens(self) -> int:
        return self.prefill + self.decode


def run_pipeline(sched, depth: int, arrivals: Optional[dict[int, list[Sequence]]] = None,
                 max_launches: int = 1000) -> list[Launched]:
    """Keeps up to `depth` micro-batches in flight, completing the oldest when the scheduler has
    nothing more or the pipeline is full; `arrivals[k]` are added before the k-th launch attempt
    round. Runs until nothing is left, or until `max_launches` were launched and have completed."""
    arrivals = dict(arrivals or {})
    in_flight: deque[MicroBatch] = deque()
    launched: list[Launched] = []
    rounds = 0
    while True:
        for seq in arrivals.pop(rounds, []):
            sched.add(seq)
        rounds += 1
        while len(in_flight) < depth and len(launched) < max_launches:
            batches = launch(sched)
            if not batches:
                break
            for batch in batches:
                launched.append(Launched(len(launched), batch.num_prefill_tokens,
                                         batch.num_decode_tokens,
                                         [item.seq.request_id for item in batch.items],
                                         sched.block_manager.usage(), len(in_flight) + 1))
                in_flight.append(batch)
        if not in_flight:
            if not arrivals or len(launched) >= max_launches:
                break
            continue
        complete(sched, in_flight.popleft())
    return launched
