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
from typing import Iterable, Optional, Union

from .config import EngineConfig
from .errors import RequestError
from .executor import Executor, StepResult
from .output import OutputProcessor
from .request import FinishReason, Request, RequestOutput, SamplingParams, Sequence, SequenceStatus
from .scheduler import MicroBatch, Scheduler
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, scheduler: Scheduler, executor: Executor, tokenizer: Tokenizer,
                 max_model_len: int, model_id: str, info: Optional[dict] = None):
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_id = model_id
        self.info = info or {}
        self.outputs = OutputProcessor(tokenizer, max_model_len)
        self._seqs: dict[str, Sequence] = {}
        self._events: list[dict] = []
        self._generate_calls = 0
        self._clock0 = time.perf_counter()
        self._counters = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0,
                          "computed_prefill_tokens": 0}

    @classmethod
    def from_config(cls, config: Optional[EngineConfig] = None) -> "Engine":
        from .build import build_engine

        return build_engine(config or EngineConfig())

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self._seqs:
            raise RequestError("duplicate_id", f"request id {request.request_id!r} is already running")
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            raise RequestError("empty_prompt", "the prompt has no tokens")
        if prompt_len >= self.max_model_len:
            raise RequestError("prompt_too_long",
                               f"the prompt has {prompt_len} tokens; max_model_len is "
                               f"{self.max_model_len}, which must leave room for at least one "
                               "generated token")
        limit = self.info.get("vocab_size") or self.tokenizer.vocab_size
        if min(request.prompt_token_ids) < 0 or max(request.prompt_token_ids) >= limit:
            bad = [t for t in request.prompt_token_ids if not 0 <= t < limit]
            raise RequestError("bad_token_id", f"prompt token ids out of range: {bad[:5]}")
        seq = Sequence(request=request, arrival_time=self.now())
        self._seqs[request.request_id] = seq
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    def now(self) -> float:
        return time.perf_counter() - self._clock0

    # --- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        finished: list[RequestOutput] = []
        for batch in self.scheduler.schedule():
            t_start = self.now()
            shape = (len(batch), batch.num_prefill_tokens, batch.num_decode_tokens)
            result = self.executor.execute(batch)
            finished.extend(self._apply(batch, result))
            self.scheduler.on_result(batch)
            self._record(batch.phase, shape, result, t_start)
        return finished

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
                done.append(self._finish(seq))
        return done

    def _finish(self, seq: Sequence) -> RequestOutput:
        self._seqs.pop(seq.request_id, None)
        self.executor.release(seq.request_id)
        self._counters["prompt_tokens"] += seq.prompt_len
        return self.outputs.result(seq)

    def abort_all(self) -> list[RequestOutput]:
        outs = []
        for seq in self.scheduler.abort_all():
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.ABORT
            seq.finish_time = self.now()
            outs.append(self._finish(seq))
        return outs

    # --- convenience ----------------------------------------------------------------------------
    def generate(self, prompts: Iterable[Union[str, list[int]]],
                 sampling: Union[SamplingParams, list[SamplingParams], None] = None) -> list[RequestOutput]:
        """Runs prompts (text or token ids) to completion; results in input order."""
        prompts = list(prompts)
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        ids = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self._generate_calls += 1
            rid = f"generate-{self._generate_calls}"
            self.add_request(Request(rid, tokens, sp, prompt=prompt if isinstance(prompt, str) else None,
                                     arrival_index=i))
            ids.append(rid)
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            for out in self.step():
                results[out.request_id] = out
        return [results[r] for r in ids]

    # --- observability --------------------------------------------------------------------------
    def _record(self, phase: str, shape: tuple[int, int, int], result: StepResult,
                t_start: float) -> None:
        self._counters["steps"] += 1
        bm = self.scheduler.block_manager
        num_seqs, num_prefill, num_decode = shape
        self._events.append({
            "t": round(t_start, 6), "dur": round(self.now() - t_start, 6),
            "phase": phase, "num_seqs": num_seqs,
            "num_prefill_tokens": num_prefill, "num_decode_tokens": num_decode,
            "forward_s": round(result.forward_s, 6), "sample_s": round(result.sample_s, 6),
            "kv_usage": round(bm.usage(), 4),
            "num_waiting": getattr(self.scheduler, "num_waiting", 0),
            "num_running": getattr(self.scheduler, "num_running", 0),
        })

    def drain_step_events(self) -> list[dict]:
        events, self._events = self._events, []
        return events

    def stats(self) -> dict:
        bm = self.scheduler.block_manager
        return {
            **self._counters,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_capacity_tokens": bm.capacity_tokens,
            "kv_usage": bm.usage(),
            "max_concurrency": bm.capacity_tokens / self.max_model_len,
            **{k: v for k, v in self.info.items() if k not in ("vocab_size",)},
        }
