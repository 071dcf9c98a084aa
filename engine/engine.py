"""The engine: requests in, finished results out. The Python API the CLI, benchmarks and tests use.

    engine = Engine.from_config(EngineConfig())
    engine.add_request(Request("r1", engine.tokenizer.encode("Hi"), SamplingParams(max_tokens=8)))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.text)

Each step: the scheduler picks micro-batches, the executor runs them, and the sampled tokens are
appended to their sequences (stop conditions checked here); finished sequences free their blocks.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Union

from .config import EngineConfig
from .errors import RequestError
from .executor import Executor, StepResult
from .kv_stats import prefix_cache_stats, swap_stats
from .output import OutputProcessor
from .parallel_sampling import ParallelSampling
from .prompt_logprobs import add_scores, prompt_slices
from .admission import check_lora, check_prompt
from .request import FinishReason, Request, RequestOutput, SamplingParams, Sequence, SequenceStatus
from .scheduler import MicroBatch, Scheduler
from .token_constraints import tokenize_bad_words
from .structured_output import check_grammar
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class Replica:
    """One copy of the model with its own scheduler, block tables and executor (data parallelism
    runs several; the engine feeds them from one shared queue)."""

    scheduler: Scheduler
    executor: Executor


class Engine:
    def __init__(self, replicas: list[Replica], tokenizer: Tokenizer, max_model_len: int,
                 model_id: str, info: Optional[dict] = None,
                 clock: Optional[Callable[[], float]] = None):
        """clock: seconds, monotonic (default time.perf_counter; the simulator's virtual clock)."""
        self.replicas = replicas
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_id = model_id
        self.info = info or {}
        self.outputs = OutputProcessor(tokenizer, max_model_len)
        self._seqs: dict[str, Sequence] = {}
        self._sampling = ParallelSampling(self)     # requests of n > 1 samples
        self._pending: deque[Sequence] = deque()   # not yet given to a replica (dp > 1)
        self._submitted: dict[int, tuple] = {}     # id(batch) -> (submit time, its shape)
        self._events: list[dict] = []
        self._generate_calls = 0
        self._closed = False
        self._clock = clock or time.perf_counter
        self._clock0 = self._clock()
        self._counters = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0,
                          "computed_prefill_tokens": 0}
        self._expert_load: Optional[dict[int, list[int]]] = None  # layer -> [expert], summed
        self._prompt_scoring = 0    # unfinished requests that ask for prompt_logprobs
        # async scheduling (steps_ahead.py), where the build chose an executor that launches ahead
        self._ahead = None
        if self.info.get("async_scheduling"):
            from .steps_ahead import StepsAhead

            self._ahead = StepsAhead(self)

    @property
    def scheduler(self) -> Scheduler:
        """The first replica's scheduler (the only one unless dp > 1)."""
        return self.replicas[0].scheduler

    @classmethod
    def from_config(cls, config: Optional[EngineConfig] = None) -> "Engine":
        from .build import build_engine

        return build_engine(config or EngineConfig())

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, request: Request, replica: Optional[int] = None) -> None:
        """replica: pin the request to that data-parallel replica (default: the least loaded
        takes it when it has room)."""
        self._check(request)
        if replica is not None and not 0 <= replica < len(self.replicas):
            raise ValueError(f"replica {replica}: the engine has {len(self.replicas)}")
        self._admit(request, replica)

    def _check(self, request: Request) -> None:
        """What a request must be before the engine takes it (RequestError / TypeError)."""
        self._check_open()
        if not isinstance(request.sampling, SamplingParams):
            raise TypeError(f"request {request.request_id!r}: sampling must be a SamplingParams, "
                            f"not {type(request.sampling).__name__}")
        taken = self._sampling.id_taken(request)
        if taken is not None:
            raise RequestError("duplicate_id", f"request id {taken!r} is already running")
        check_prompt(request, self.max_model_len, self.vocab_size)
        check_lora(request, self.info.get("lora_modules"))     # its adapter's slot
        tokenize_bad_words(request, self.tokenizer, self.vocab_size)
        if request.sampling.structured_outputs is not None:     # compiled once per spec
            check_grammar(request, self.tokenizer, self.vocab_size)

    @property
    def vocab_size(self) -> int:
        """The model's token ids are 0..vocab_size-1 (its embedding's rows; the tokenizer's
        length where the engine does not say)."""
        return self.info.get("vocab_size") or self.tokenizer.vocab_size

    def _admit(self, request: Request, replica: Optional[int] = None) -> None:
        if request.sampling.n > 1:
            return self._sampling.add(request, replica)      # its samples' sequences
        seq = Sequence(request=request, arrival_time=self.now())
        self._register(seq)
        self._place(seq, replica)

    def _register(self, seq: Sequence) -> None:
        request = seq.request
        self._seqs[request.request_id] = seq
        if self._ahead is not None and request.sampling.reads_output_tokens:
            self._ahead.penalised += 1
        if request.sampling.prompt_logprobs is not None:
            self._prompt_scoring += 1

    def _place(self, seq: Sequence, replica: Optional[int] = None) -> None:
        if len(self.replicas) == 1 or replica is not None:
            self.replicas[replica or 0].scheduler.add(seq)
        else:
            self._pending.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self._sampling.holding or any(
            rep.scheduler.has_unfinished() or rep.executor.num_in_flight for rep in self.replicas)

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    def progress(self) -> dict[str, int]:
        """Output tokens generated so far by each unfinished request (the online length
        predictor's lower bounds on the replies still decoding; of n samples, the longest)."""
        return self._sampling.progress(self._seqs)

    def now(self) -> float:
        return self._clock() - self._clock0

    # --- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Keeps every replica's pipeline full, then applies whatever micro-batches finished
        (at least one, unless there is nothing to run); returns the requests that finished."""
        self._check_open()
        self._sampling.release_ready()
        self._feed()
        for rep in self.replicas:
            self._fill(rep)
        for rep in self.replicas:      # every replica has been offered work this step
            rep.executor.flush_submissions()
        busy = [rep for rep in self.replicas
                 if rep.executor.num_in_flight or rep.executor.num_pending_transfers]
        if not busy:
            stalled = [rep.scheduler for rep in self.replicas if rep.scheduler.has_unfinished()]
            if stalled:
                # nothing in flight will free blocks or advance a request: the scheduler would be
                # asked the same question forever
                raise RuntimeError(
                    f"scheduler {type(stalled[0]).__name__} has {stalled[0].num_waiting} waiting "
                    f"and {stalled[0].num_running} running requests but schedules nothing")
            return []
        while not any(rep.executor.ready() or rep.executor.transfers_ready() for rep in busy):
            busy[0].executor.wait()
        finished: list[RequestOutput] = []
        for index, rep in enumerate(self.replicas):
            if rep.executor.num_pending_transfers or rep.executor.transfers_ready():
                rep.scheduler.on_transfers_done(rep.executor.take_done_transfers())
            while rep.executor.num_in_flight and rep.executor.ready():
                batch, result = rep.executor.collect()
                t_start, shape = self._submitted.pop(id(batch))
                if result.prompt_logprobs:
                    add_scores(batch, result.prompt_logprobs)
                if self._ahead is not None:
                    done, batch = self._ahead.settle(batch, result)
                    finished.extend(done)
                    # steps overlap: each is timed from the later of its launch and the last
                    # step's return, so the report's busy time does not count a span twice
                    t_start = max(t_start, self._ahead.last_settled)
                    self._ahead.last_settled = self.now()
                else:
                    for item in batch.items:
                        item.seq.in_flight = False
                    finished.extend(self._apply(batch, result))
                rep.scheduler.on_result(batch)
                release_outside_windows(rep.scheduler.block_manager, batch)
                self._record(rep, index, batch.phase, shape, result, t_start)
        return finished

    def _fill(self, rep: Replica) -> None:
        _run_actions(rep)
        while rep.executor.num_in_flight < rep.scheduler.in_flight_limit(rep.executor.max_in_flight):
            if rep.executor.num_in_flight and self._ahead is not None and \
                    not self._ahead.may_launch_ahead(rep):
                return
            batches = rep.scheduler.schedule()
            _run_actions(rep)    # copies and layout switches go before the micro-batches
            if not batches:
                return
            for batch in batches:
                if self._prompt_scoring:
                    batch.prompt_scores = prompt_slices(batch)
                decode = batch.num_decode_tokens
                for item in batch.items:
                    item.seq.in_flight = True
                context = sum(item.seq.num_computed_tokens + item.num_tokens
                              for item in batch.items)
                self._submitted[id(batch)] = (self.now(),
                                              (len(batch), batch.num_tokens - decode, decode,
                                               context))
                rep.executor.submit(batch)
                if self._ahead is not None:
                    self._ahead.launched(batch)

    def _feed(self) -> None:
        """Data parallelism: a replica takes new requests only while its own queue is short
        (below its scheduler's `feed_tokens`), so the one that finishes early takes more (no
        static split that idles one at the tail)."""
        while self._pending:
            hungry = [rep for rep in self.replicas
                      if rep.scheduler.num_waiting_tokens < rep.scheduler.feed_tokens]
            if not hungry:
                return
            rep = min(hungry, key=lambda r: (r.scheduler.num_waiting + r.scheduler.num_running))
            rep.scheduler.add(self._pending.popleft())

    def _apply(self, batch: MicroBatch, result: StepResult) -> list[RequestOutput]:
        now = self.now()
        done = []
        for item, token, logprob in zip(batch.items, result.tokens, result.logprobs):
            seq = item.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            if seq.num_computed_tokens < seq.prompt_len:
                self._counters["computed_prefill_tokens"] += item.num_tokens
            seq.num_computed_tokens += item.num_tokens
            if token is None:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            self._counters["generation_tokens"] += 1
            if self.outputs.append(seq, token, logprob):
                seq.finish_time = now
                seq.status = SequenceStatus.FINISHED
                self._finish(seq, done)
        return done

    def _finish(self, seq: Sequence, into: list[RequestOutput]) -> None:
        """`seq` ended: its request's result goes `into` (of n samples, once all ended)."""
        if self._ahead is not None and seq.request.sampling.reads_output_tokens and \
                self._seqs.get(seq.request_id) is seq:
            self._ahead.penalised -= 1
        if seq.request.sampling.prompt_logprobs is not None and \
                self._seqs.get(seq.request_id) is seq:
            self._prompt_scoring -= 1
        self._seqs.pop(seq.request_id, None)
        for rep in self.replicas:
            rep.executor.release(seq.request_id)
        out = self._sampling.finished(seq, self.outputs.result(seq))
        if out is not None:
            self._counters["prompt_tokens"] += seq.prompt_len
            into.append(out)

    def abort_all(self) -> list[RequestOutput]:
        """Drops everything: in-flight micro-batches are waited for and their results discarded."""
        seqs = list(self._pending)
        self._pending.clear()
        for rep in self.replicas:
            while rep.executor.num_in_flight:
                while not rep.executor.ready():
                    rep.executor.wait()
                batch, _ = rep.executor.collect()
                if self._ahead is not None:
                    self._ahead.discard(batch)
                for item in batch.items:
                    item.seq.in_flight = False
            seqs.extend(rep.scheduler.abort_all())
        seqs.extend(self._sampling.take_held())
        outs: list[RequestOutput] = []
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.ABORT
            seq.finish_time = self.now()
            self._finish(seq, outs)
        return outs

    def close(self) -> None:
        """Stops worker processes (if any): an engine that had them is unusable afterwards
        (adding or stepping says so); closing again does nothing."""
        if self._closed:
            return
        failed = None
        for rep in self.replicas:      # every replica is asked, whatever one of them raises
            try:
                rep.executor.close()
            except Exception as exc:   # noqa: BLE001 - raised once all were asked
                failed = failed or exc
        self._closed = any(rep.executor.stops_on_close for rep in self.replicas)
        if failed is not None:
            raise failed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed (close() or the end of its `with` block): "
                               "build a new one with Engine.from_config")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- convenience ----------------------------------------------------------------------------
    def generate(self, prompts: Iterable[Union[str, list[int]]],
                 sampling: Union[SamplingParams, list[SamplingParams], None] = None,
                 on_step: Optional[Callable[[list[RequestOutput]], None]] = None) -> list[RequestOutput]:
        """Runs prompts (one text, or a list of texts or of token-id lists) to completion;
        results in input order. `sampling`: one SamplingParams for all, or one per prompt.
        Every prompt is checked before any is added, so a bad one leaves nothing behind.
        `on_step`, if given, is called after every step with the requests that step finished.
        Requests added with add_request and not yet finished are refused: their results would
        come out of generate's steps, not the caller's. A call interrupted (Ctrl-C, an exception
        from on_step or a step) aborts its own requests and leaves the engine idle."""
        if self.has_unfinished():
            raise RuntimeError("generate runs its prompts to completion on an idle engine, and "
                               "requests added with add_request are unfinished: step() until "
                               "has_unfinished() is false first (or abort them)")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if prompts and all(isinstance(p, int) for p in prompts):
            raise TypeError("prompts is a list of ints: give token-id prompts as a list of lists "
                            "([[1, 2, 3]])")
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts and {len(sampling)} sampling params: "
                                 "give one SamplingParams for all, or one per prompt")
            params = list(sampling)
        else:
            params = [sampling or SamplingParams()] * len(prompts)
        requests = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__len__"):
                raise TypeError(f"prompt {i}: a text or a sequence of token ids, not "
                                f"{type(prompt).__name__}")
            tokens = (self.tokenizer.encode(prompt) if isinstance(prompt, str)
                      else [t.item() if hasattr(t, "item") else t for t in prompt])
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling params of prompt {i}: a SamplingParams, not "
                                f"{type(sp).__name__}")
            request = Request(f"generate-{self._generate_calls + i + 1}", tokens, sp,
                              prompt=prompt if isinstance(prompt, str) else None, arrival_index=i)
            try:
                self._check(request)
            except RequestError as exc:
                raise RequestError(exc.code, f"prompt {i}: {exc.message}") from None
            requests.append(request)
        self._generate_calls += len(requests)
        for request in requests:         # every one checked: none fails half-way
            self._admit(request)
        ids = [request.request_id for request in requests]
        results: dict[str, RequestOutput] = {}
        try:
            while len(results) < len(ids):
                finished = self.step()
                for out in finished:
                    results[out.request_id] = out
                if on_step is not None:
                    on_step(finished)
        except BaseException:
            # a Ctrl-C, an error in on_step or in a step: the call's results are lost with it, so
            # its requests (the only ones: generate runs on an idle engine) go too, and the next
            # call finds an idle engine instead of being refused for requests it never added
            try:
                self.abort_all()
            except Exception:   # noqa: BLE001 - a dead worker: the first error is the one to see
                pass
            raise
        return [results[r] for r in ids]

    # --- observability --------------------------------------------------------------------------
    def _record(self, rep: Replica, replica_index: int, phase: str,
                shape: tuple[int, int, int, int], result: StepResult, t_start: float) -> None:
        """shape: (sequences, prefill tokens, decode tokens, context tokens: each sequence's
        length at the end of the step (its cached tokens and the step's), summed)."""
        self._counters["steps"] += 1
        scheduler = rep.scheduler
        num_seqs, num_prefill, num_decode, num_context = shape
        event = {
            "t": round(t_start, 6), "dur": round(self.now() - t_start, 6),
            "phase": phase, "num_seqs": num_seqs,
            "num_prefill_tokens": num_prefill, "num_decode_tokens": num_decode,
            "num_context_tokens": num_context,
            "forward_s": round(result.forward_s, 6), "sample_s": round(result.sample_s, 6),
            "kv_usage": round(scheduler.block_manager.usage(), 4),
            "num_waiting": scheduler.num_waiting,
            "num_running": scheduler.num_running,
            **scheduler.step_stats(), **rep.executor.step_stats(),
        }
        if result.expert_load:     # a mixture of experts: tokens per expert, layers summed
            event["expert_tokens"] = [sum(column) for column in zip(*result.expert_load.values())]
            self._add_expert_load(result.expert_load)
        if len(self.replicas) > 1:
            event["replica"] = replica_index
        decisions = scheduler.drain_decisions()
        if decisions:
            event["decisions"] = decisions
        self._events.append(event)

    def _add_expert_load(self, load: dict[int, list[int]]) -> None:
        if self._expert_load is None:
            self._expert_load = {}
        for layer, row in load.items():
            total = self._expert_load.setdefault(layer, [0] * len(row))
            for expert, tokens in enumerate(row):
                total[expert] += tokens

    def expert_load(self) -> Optional[dict]:
        """Tokens routed to each expert so far: per sparse layer (`layers` names them), summed
        over the layers, and the busiest expert's share against an even split (1.0: perfectly
        balanced); None for a dense model."""
        if self._expert_load is None:
            return None
        layers = sorted(self._expert_load)
        per_layer = [list(self._expert_load[layer]) for layer in layers]
        per_expert = [sum(column) for column in zip(*per_layer)]
        mean = sum(per_expert) / len(per_expert)
        return {"per_expert": per_expert, "per_layer": per_layer, "layers": layers,
                "max_over_mean": round(max(per_expert) / mean, 4) if mean else None}

    def drain_step_events(self) -> list[dict]:
        events, self._events = self._events, []
        return events

    def timeline(self, last: Optional[int] = None) -> list[dict]:
        """Per-rank forward / send / receive intervals, oldest first (multi-process executors;
        else empty). `last`: only the most recent events."""
        return self.replicas[0].executor.timeline(last)

    def keep_timeline(self, max_events: int) -> None:
        """Holds up to `max_events` timeline events from now on (a job holds what its report
        draws, runtime/pool.EVENTS_KEEP; a benchmark reading the whole timeline asks for more)."""
        for replica in self.replicas:
            replica.executor.keep_timeline(max_events)

    def stats(self) -> dict:
        managers = [rep.scheduler.block_manager for rep in self.replicas]
        capacity = sum(bm.capacity_tokens for bm in managers)
        used = sum(bm.usage() * bm.capacity_tokens for bm in managers)
        pipeline = self.replicas[0].executor.pipeline_summary()
        strategy_stats = {**self.replicas[0].scheduler.strategy_summary(),
                          **self.replicas[0].executor.strategy_summary()}
        return {
            **self._counters,
            **({"pipeline": pipeline} if pipeline else {}),
            **({"strategy_stats": strategy_stats} if strategy_stats else {}),
            **prefix_cache_stats(managers),
            **swap_stats(managers),
            **({"expert_load": self.expert_load()} if self._expert_load is not None else {}),
            "num_preemptions": sum(rep.scheduler.num_preemptions for rep in self.replicas),
            "kv_capacity_tokens": capacity,
            "kv_window_freed_blocks": sum(bm.window_freed_blocks for bm in managers),
            "kv_usage": used / capacity if capacity else 0.0,
            "max_concurrency": sum(bm.max_concurrency(self.max_model_len) for bm in managers),
            **{k: v for k, v in self.info.items() if k not in ("vocab_size",)},
        }


def release_outside_windows(block_manager, batch: MicroBatch) -> None:
    """Sliding windows (the block manager has one; with KV layer groups, its windowed groups):
    after a step, each sequence it ran that goes on releases the blocks its next queries cannot
    see. After the scheduler's on_result, so the
    prefix cache indexed the step's blocks first. With steps launched ahead the host's count is
    ahead of the device: a block an in-flight step still reads is only reused by a step launched
    after it, on the same stream."""
    if not block_manager.window:
        return
    for item in batch.items:
        seq = item.seq
        if not seq.is_finished:
            block_manager.release_outside_window(seq.request_id, seq.num_computed_tokens)


def _run_actions(rep: Replica) -> None:
    """KV copies between tiers and layout switches the scheduler decided go to the executor."""
    actions = rep.scheduler.take_actions()
    if actions:
        rep.executor.run_actions(actions)

