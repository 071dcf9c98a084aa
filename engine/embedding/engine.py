"""The embedding engine: prompt-only forwards of a transformers AutoModel (any encoder transformers
runs: BERT, XLM-RoBERTa, ...; or a decoder embedding model: Qwen3-Embedding, gte-Qwen2,
e5-mistral), pooled per input (engine/embedding/pooling.py).

The job loop drives it as it drives the generation engine (add_request / step / has_unfinished /
abort_all / stats / drain_step_events / tokenizer / info / close). Each step runs one padded
batch: the waiting inputs sorted by length, the batch grown around the oldest of them (shorter
neighbours first: they add no padding, then longer ones) while rows x the longest row stays within
the scheduler's max_num_batched_tokens and the rows within max_num_seqs; an input longer than the
budget runs alone. A request with several inputs finishes when its last input is pooled.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import EngineConfig
from ..device import resolve_device
from ..errors import ConfigError, ModelLoadError, RequestError
from ..request import FinishReason
from .model_source import EmbeddingSource, embedding_source
from .pooler_config import bidirectional_decoder_problem
from .pooling import finish, pool
from .request import EmbeddingOutput, EmbeddingRequest

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Pending:
    request: EmbeddingRequest
    dimensions: Optional[int]
    normalize: bool
    results: list
    left: int
    arrival: float


@dataclass(eq=False)
class _Input:
    pending: _Pending
    index: int
    tokens: list[int]
    order: int          # admission order: the oldest waiting input anchors the next batch


def pick_batch(lengths: list[int], orders: list[int], max_tokens: int, max_rows: int) -> list[int]:
    """Indices (into `lengths`, sorted ascending) of the next batch: a run of neighbours around
    the oldest input (smallest order), shorter ones first, padded cost rows x longest within
    max_tokens (one input at least)."""
    anchor = min(range(len(lengths)), key=orders.__getitem__)
    lo = hi = anchor
    while hi - lo + 1 < max_rows:
        rows = hi - lo + 2
        if lo > 0 and rows * lengths[hi] <= max_tokens:
            lo -= 1
        elif hi + 1 < len(lengths) and rows * lengths[hi + 1] <= max_tokens:
            hi += 1
        else:
            break
    return list(range(lo, hi + 1))


def check_embedding_request(request: EmbeddingRequest, max_model_len: int, vocab_size: int,
                            pooling) -> None:
    """An input without tokens, longer than max_model_len or with ids past the vocabulary, or
    dimensions the model cannot give: a RequestError naming it (`batchinfer validate` too)."""
    if not request.inputs:
        raise RequestError("empty_prompt", "the request has no input")
    many = len(request.inputs) > 1
    for i, ids in enumerate(request.inputs):
        which = f"input {i} " if many else "the prompt "
        if not ids:
            raise RequestError("empty_prompt", f"{which}has no tokens")
        if len(ids) > max_model_len:
            raise RequestError("prompt_too_long", (
                f"{which}has {len(ids)} tokens; this model's maximum context length is "
                f"{max_model_len} tokens (max_model_len): shorten it, or set "
                "truncate_prompt_tokens"))
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError("invalid_prompt", f"{which}holds token id {bad}, outside the "
                               f"vocabulary [0, {vocab_size})")
    if request.dimensions is not None:
        problem = pooling.dimensions_problem(request.dimensions)
        if problem:
            raise RequestError("invalid_dimensions", f"dimensions: {problem}")


def resolve_embed_dtype(choice: str, device: torch.device, hf_config: dict) -> torch.dtype:
    """model.dtype: on CPU auto is fp32 (transformers' bf16 CPU path is no faster on most hosts);
    on CUDA auto is the checkpoint's bf16 / fp16, else fp32."""
    named = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if choice != "auto":
        return named[choice]
    saved = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if device.type == "cuda" and saved in ("bfloat16", "float16"):
        return named[saved]
    return torch.float32


def load_embedding_model(source: EmbeddingSource, config: EngineConfig, device: torch.device,
                         dtype: torch.dtype):
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()       # (a bar per load in the job's log)
    model_cfg = config.model
    try:
        hf_config = AutoConfig.from_pretrained(str(source.model_dir))
        for key, value in (model_cfg.hf_overrides or {}).items():
            setattr(hf_config, key, value)
        if model_cfg.load_format == "dummy":
            torch.manual_seed(model_cfg.seed)
            model = AutoModel.from_config(hf_config, dtype=dtype)
        else:
            model = AutoModel.from_pretrained(str(source.model_dir), config=hf_config, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"model.path: {source.model_dir}: transformers could not load it "
                             f"as an embedding model (AutoModel): {type(exc).__name__}: {exc}") \
            from None
    return model.to(device).eval()


class EmbeddingEngine:
    def __init__(self, source: EmbeddingSource, model, device: torch.device, dtype: torch.dtype,
                 max_num_batched_tokens: int, max_num_seqs: int):
        self.source = source
        self.model = model
        self.device = device
        self.tokenizer = source.tokenizer
        self.model_id = source.model_id
        self.max_model_len = source.max_model_len
        self.pooling = source.pooling
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        hf = getattr(source.tokenizer, "hf", None)
        pad = getattr(hf, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else source.hf_config.get("pad_token_id") or 0)
        self.info = {"task": "embed", "model": source.model_id, "device": str(device),
                     "dtype": str(dtype).removeprefix("torch."),
                     "max_model_len": source.max_model_len,
                     "pooler": source.pooling.describe(), "vocab_size": source.vocab_size,
                     "max_num_batched_tokens": max_num_batched_tokens,
                     "max_num_seqs": max_num_seqs}
        self._waiting: list[_Input] = []
        self._pending: dict[str, _Pending] = {}
        self._orders = itertools.count()
        self._events: list[dict] = []
        self._counters = {"steps": 0, "computed_prefill_tokens": 0, "padded_tokens": 0,
                          "generation_tokens": 0}
        self._t0 = time.perf_counter()

    @classmethod
    def from_config(cls, config: Optional[EngineConfig] = None) -> "EmbeddingEngine":
        config = config or EngineConfig()
        device = resolve_device(config.device.device)
        if device.type == "cpu" and config.device.num_threads:
            torch.set_num_threads(config.device.num_threads)
        source = embedding_source(config.model)
        problem = bidirectional_decoder_problem(source.hf_config)
        if problem:
            raise ConfigError(problem)
        dtype = resolve_embed_dtype(config.model.dtype, device, source.hf_config)
        model = load_embedding_model(source, config, device, dtype)
        return cls(source, model, device, dtype, config.scheduler.max_num_batched_tokens,
                   config.scheduler.max_num_seqs)

    @property
    def vocab_size(self) -> int:
        return self.source.vocab_size

    def now(self) -> float:
        return time.perf_counter() - self._t0

    # --- requests -------------------------------------------------------------------------------
    def check(self, request: EmbeddingRequest) -> None:
        """The refusals of one request (RequestError: its error record; the job goes on)."""
        if request.request_id in self._pending:
            raise RequestError("duplicate_id", f"request id {request.request_id!r} is already "
                               "in the engine")
        check_embedding_request(request, self.max_model_len, self.vocab_size, self.pooling)

    def add_request(self, request: EmbeddingRequest) -> None:
        self.check(request)
        dims = request.dimensions if request.dimensions is not None else self.pooling.dimensions
        normalize = (request.use_activation if request.use_activation is not None
                     else self.pooling.use_activation)
        pending = _Pending(request, dims, normalize, [None] * len(request.inputs),
                           len(request.inputs), self.now())
        self._pending[request.request_id] = pending
        for i, ids in enumerate(request.inputs):
            self._waiting.append(_Input(pending, i, list(ids), next(self._orders)))

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def num_unfinished(self) -> int:
        return len(self._pending)

    # --- steps ----------------------------------------------------------------------------------
    def step(self) -> list[EmbeddingOutput]:
        if not self._waiting:
            return []
        t_start = self.now()
        self._waiting.sort(key=lambda item: len(item.tokens))
        chosen = pick_batch([len(item.tokens) for item in self._waiting],
                            [item.order for item in self._waiting],
                            self.max_num_batched_tokens, self.max_num_seqs)
        batch = [self._waiting[i] for i in chosen]
        del self._waiting[chosen[0]:chosen[-1] + 1]
        vectors = self._embed(batch)
        finished: list[EmbeddingOutput] = []
        now = self.now()
        for item, vector in zip(batch, vectors):
            pending = item.pending
            pending.results[item.index] = vector
            pending.left -= 1
            if pending.left == 0:
                finished.append(self._finish(pending, now))
        tokens = sum(len(item.tokens) for item in batch)
        padded = len(batch) * max(len(item.tokens) for item in batch)
        self._counters["steps"] += 1
        self._counters["computed_prefill_tokens"] += tokens
        self._counters["padded_tokens"] += padded
        self._events.append({
            "t": round(t_start, 6), "dur": round(now - t_start, 6), "phase": "prefill",
            "num_seqs": len(batch), "num_prefill_tokens": tokens, "num_decode_tokens": 0,
            "num_context_tokens": tokens, "padded_tokens": padded, "kv_usage": 0.0,
            "num_waiting": len(self._waiting), "num_running": 0})
        return finished

    @torch.inference_mode()
    def _embed(self, batch: list[_Input]) -> list[list[float]]:
        lengths = [len(item.tokens) for item in batch]
        width = max(lengths)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, item in enumerate(batch):
            ids[row, :len(item.tokens)] = torch.tensor(item.tokens, dtype=torch.long)
            mask[row, :len(item.tokens)] = 1
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        pooled = pool(hidden, lengths, self.pooling.pooling_type)
        return finish(pooled.cpu(), [item.pending.dimensions for item in batch],
                      [item.pending.normalize for item in batch])

    def _finish(self, pending: _Pending, now: float) -> EmbeddingOutput:
        request = pending.request
        del self._pending[request.request_id]
        return EmbeddingOutput(request.request_id, pending.results, request.num_prompt_tokens,
                               payload=request.payload, arrival_time=pending.arrival,
                               finish_time=now)

    def abort_all(self) -> list[EmbeddingOutput]:
        now = self.now()
        out = [EmbeddingOutput(p.request.request_id, [], p.request.num_prompt_tokens,
                               finish_reason=FinishReason.ABORT, payload=p.request.payload,
                               arrival_time=p.arrival, finish_time=now)
               for p in self._pending.values()]
        self._pending.clear()
        self._waiting.clear()
        return out

    # --- observability --------------------------------------------------------------------------
    def drain_step_events(self) -> list[dict]:
        events, self._events = self._events, []
        return events

    def stats(self) -> dict:
        return {**self._counters, "num_preemptions": 0,
                **{k: v for k, v in self.info.items() if k != "vocab_size"}}

    def close(self) -> None:
        """Nothing to stop (one process): what was queued goes; the engine stays usable."""
        self._pending.clear()
        self._waiting.clear()

    def __enter__(self) -> "EmbeddingEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def embed(self, prompts: list, dimensions: Optional[int] = None) -> list[list[float]]:
        """Embeds `prompts` (texts or token ids) on an idle engine, one vector each (a
        convenience, as vLLM's LLM.embed)."""
        for i, prompt in enumerate(prompts):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.add_request(EmbeddingRequest(f"embed-{i}", [ids], dimensions=dimensions))
        results: dict[str, list[float]] = {}
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id] = out.embeddings[0]
        return [results[f"embed-{i}"] for i in range(len(prompts))]
