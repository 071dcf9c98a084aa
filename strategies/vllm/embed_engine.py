"""An embedding job (`model.task: embed`) with strategy `vllm`: vLLM's pooling runner in a worker
process (strategies/vllm/embed_worker.py: `LLM(runner="pooling")`, `llm.embed`), driven as the job
loop drives the embedding engine. Inputs go over as our tokenizer's token ids (so both engines
embed the same tokens, truncation and chat templates applied here); the recipe's pooler_config
goes to vLLM as its PoolerConfig. Each step sends the waiting requests (at most max_num_seqs
inputs) as one llm.embed call."""
from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.device import resolve_device
from batchinfer.engine.embedding.engine import check_embedding_request
from batchinfer.engine.embedding.model_source import embedding_source
from batchinfer.engine.embedding.request import EmbeddingOutput, EmbeddingRequest
from batchinfer.engine.errors import RequestError
from batchinfer.engine.request import FinishReason

from .engine import _read, send_to_worker, start_worker, stop_worker
from .params import VllmParams, engine_args, engine_env, vllm_python

log = logging.getLogger(__name__)
EMBED_WORKER = Path(__file__).with_name("embed_worker.py")


def embed_engine_args(config: EngineConfig, params: VllmParams, source, device: str) -> dict:
    """The generation job's mapping (engine_args) plus vLLM's pooling runner: runner pooling,
    the recipe's pooler_config keys, our max_model_len (the sentence-transformers one vLLM
    derives too)."""
    args = engine_args(config, params, source.model_dir, device)
    args.pop("enable_prefix_caching", None)
    args["runner"] = "pooling"
    args["max_model_len"] = source.max_model_len
    pooler = config.model.pooler_config
    if pooler is not None:
        keys = pooler.model_dump(exclude_none=True)
        if keys:
            args["pooler_config"] = keys
    args.update(params.engine_args)
    return args


class VllmEmbeddingEngine:
    def __init__(self, proc: subprocess.Popen, source, info: dict, max_inputs: int):
        self._proc = proc
        self.source = source
        self.tokenizer = source.tokenizer
        self.model_id = source.model_id
        self.max_model_len = source.max_model_len
        self.vocab_size = source.vocab_size
        self.info = info
        self._max_inputs = max_inputs
        self._waiting: list[tuple[EmbeddingRequest, float]] = []
        self._events: list[dict] = []
        self._counters = {"steps": 0, "computed_prefill_tokens": 0, "generation_tokens": 0}
        self._t0 = time.perf_counter()

    @classmethod
    def start(cls, config: EngineConfig, params: VllmParams) -> "VllmEmbeddingEngine":
        python = vllm_python(params)
        device = resolve_device(config.device.device).type
        source = embedding_source(config.model)
        args = embed_engine_args(config, params, source, device)
        log.info("starting vLLM's pooling runner under %s: %s", python, args)
        proc, facts = start_worker(EMBED_WORKER, python, args,
                                   engine_env(config, device=device),
                                   params.startup_timeout_seconds)
        info = {"task": "embed", "device": device, "dtype": args["dtype"], "strategy": "vllm",
                "model_id": source.model_id, "max_model_len": source.max_model_len,
                "pooler": {**source.pooling.describe(), "vllm": facts.get("pooler")},
                "strategy_stats": {"vllm_version": facts.get("vllm_version"), "python": python,
                                   "engine_args": args}}
        return cls(proc, source, info, params.max_num_seqs)

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def add_request(self, request: EmbeddingRequest) -> None:
        if any(r.request_id == request.request_id for r, _ in self._waiting):
            raise RequestError("duplicate_id", f"request id {request.request_id!r} is already "
                               "waiting")
        check_embedding_request(request, self.max_model_len, self.vocab_size,
                                self.source.pooling)
        self._waiting.append((request, self.now()))

    def has_unfinished(self) -> bool:
        return bool(self._waiting)

    def num_unfinished(self) -> int:
        return len(self._waiting)

    def step(self) -> list[EmbeddingOutput]:
        if not self._waiting:
            return []
        t_start = self.now()
        batch, inputs = [], 0
        while self._waiting and (not batch or inputs + len(self._waiting[0][0].inputs)
                                 <= self._max_inputs):
            batch.append(self._waiting.pop(0))
            inputs += len(batch[-1][0].inputs)
        self._send({"op": "embed", "requests": [
            {"id": r.request_id, "inputs": r.inputs, "dimensions": r.dimensions,
             "use_activation": r.use_activation} for r, _ in batch]})
        reply = _read(self._proc)
        now = self.now()
        done = {d["id"]: d["embeddings"] for d in reply.get("done", [])}
        failed = {e["id"]: e["error"] for e in reply.get("errors", [])}
        outs = []
        for request, arrival in batch:
            error = failed.get(request.request_id)
            outs.append(EmbeddingOutput(
                request.request_id, done.get(request.request_id, []), request.num_prompt_tokens,
                finish_reason=FinishReason.ERROR if error else FinishReason.STOP,
                payload=request.payload, error=f"vLLM: {error}" if error else None,
                arrival_time=arrival, finish_time=now))
        tokens = sum(r.num_prompt_tokens for r, _ in batch)
        self._counters["steps"] += 1
        self._counters["computed_prefill_tokens"] += tokens
        self._events.append({"t": round(t_start, 6), "dur": round(now - t_start, 6),
                             "phase": "prefill", "num_seqs": inputs,
                             "num_prefill_tokens": tokens, "num_decode_tokens": 0,
                             "kv_usage": 0.0, "num_waiting": len(self._waiting),
                             "num_running": 0})
        return outs

    def abort_all(self) -> list[EmbeddingOutput]:
        now = self.now()
        outs = [EmbeddingOutput(r.request_id, [], r.num_prompt_tokens,
                                finish_reason=FinishReason.ABORT, payload=r.payload,
                                arrival_time=arrival, finish_time=now)
                for r, arrival in self._waiting]
        self._waiting.clear()
        return outs

    def drain_step_events(self) -> list[dict]:
        events, self._events = self._events, []
        return events

    def stats(self) -> dict:
        return {**self._counters, "num_preemptions": 0, **self.info}

    def close(self) -> None:
        stop_worker(self._proc)

    def _send(self, message: dict) -> None:
        send_to_worker(self._proc, message)
