"""What one finished or failed request looks like on disk.

Plain and chat inputs get a flat record; OpenAI batch inputs get the OpenAI batch *output* envelope
(id, custom_id, response {status_code, request_id, body}, error), so existing tooling reads it.
Ids in the envelope are derived from custom_id, so a resumed run writes the same ones.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Optional

from .input_records import InputError, RequestSpec
from batchinfer.engine.parallel_sampling import ParallelOutput
from batchinfer.engine.request import RequestOutput


@dataclass
class RequestPayload:
    """Rides through the engine on Request.payload: what the writer needs besides the result."""

    line: int
    metadata: Optional[dict] = None
    custom_id: Optional[str] = None
    openai_url: Optional[str] = None
    openai_model: Optional[str] = None
    order: int = 0               # admission order in this session (for output_order: input)
    # for history.jsonl (the length predictors' training data)
    prompt_text: Optional[str] = None    # the prompt as predictors see it (chat rendered)
    max_tokens: Optional[int] = None
    predicted_tokens: Optional[int] = None
    lora: Optional[str] = None           # the LoRA adapter it ran with (None: the base model)

    @classmethod
    def from_spec(cls, spec: RequestSpec, order: int) -> "RequestPayload":
        return cls(line=spec.line, metadata=spec.metadata, custom_id=spec.custom_id,
                   openai_url=spec.openai_url, openai_model=spec.extra.get("model"), order=order,
                   max_tokens=spec.sampling.max_tokens if spec.sampling is not None else None)


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def output_record(out: RequestOutput, payload: RequestPayload, model_id: str) -> dict:
    if payload.openai_url:
        return openai_output(out, payload, model_id)
    record: dict[str, Any] = {
        "id": out.request_id,
        "text": out.text,
        "finish_reason": _reason(out.finish_reason),
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
    }
    if out.stop_reason is not None:
        record["stop_reason"] = out.stop_reason
    if out.logprobs is not None:
        record["logprobs"] = out.logprobs
    if out.prompt_logprobs is not None:
        record["prompt_logprobs"] = out.prompt_logprobs
    if payload.lora is not None:
        record["lora"] = payload.lora
    if payload.metadata is not None:
        record["metadata"] = payload.metadata
    if isinstance(out, ParallelOutput):
        return _with_samples(record, out)
    return record


# a flat record's keys that describe one reply: of n samples, each sample's own in `outputs`
_REPLY_KEYS = ("text", "finish_reason", "stop_reason", "logprobs")


def _with_samples(record: dict, out: ParallelOutput) -> dict:
    """The flat record of a request of n samples, after vLLM's RequestOutput: `outputs` holds
    each sample's reply in index order (its text, token ids, finish and stop reasons, logprobs)
    in place of the one reply's keys; completion_tokens counts every sample's tokens."""
    samples = []
    for index, sample in enumerate(out.samples):
        entry: dict[str, Any] = {"index": index, "text": sample.text,
                                 "token_ids": list(sample.output_token_ids),
                                 "finish_reason": _reason(sample.finish_reason)}
        if sample.stop_reason is not None:
            entry["stop_reason"] = sample.stop_reason
        if sample.logprobs is not None:
            entry["logprobs"] = sample.logprobs
        samples.append(entry)
    return {"id": record["id"], "outputs": samples,
            **{k: v for k, v in record.items() if k != "id" and k not in _REPLY_KEYS}}


def _reason(reason: Any) -> str:
    return getattr(reason, "value", reason)


def openai_output(out: RequestOutput, payload: RequestPayload, model_id: str) -> dict:
    key = _short_hash(payload.custom_id or out.request_id)
    chat = payload.openai_url == "/v1/chat/completions"
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": out.text}
        choice["logprobs"] = _chat_logprobs(out.logprobs) if out.logprobs is not None else None
    else:
        choice["text"] = out.text
        choice["logprobs"] = _completion_logprobs(out.logprobs) if out.logprobs is not None else None
    choice["finish_reason"] = _reason(out.finish_reason)
    prompt_logprobs = (_server_prompt_logprobs(out.prompt_logprobs)
                       if out.prompt_logprobs is not None else None)
    if prompt_logprobs is not None and not chat:      # vLLM's server: on the choice ...
        choice["prompt_logprobs"] = prompt_logprobs
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{key}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": payload.openai_model or model_id,
        "choices": [choice],
        "usage": {"prompt_tokens": out.num_prompt_tokens,
                  "completion_tokens": out.num_output_tokens,
                  "total_tokens": out.num_prompt_tokens + out.num_output_tokens},
    }
    if prompt_logprobs is not None and chat:          # ... or the chat response's
        body["prompt_logprobs"] = prompt_logprobs
    if isinstance(out, ParallelOutput):     # n samples: a choice each, as OpenAI answers n
        body["choices"] = [_sample_choice(sample, index, payload, model_id)
                           for index, sample in enumerate(out.samples)]
        if prompt_logprobs is not None and not chat:    # vLLM's server: on every choice
            for sample_choice in body["choices"]:
                sample_choice["prompt_logprobs"] = prompt_logprobs
    return openai_response_line(key, payload, body)


def openai_response_line(key: str, payload: "RequestPayload", body: dict) -> dict:
    """A finished OpenAI batch line's output record around its response `body` (key: the
    request's short hash, which the batch, response and body ids derive from)."""
    record = {"id": f"batch_req_{key}", "custom_id": payload.custom_id,
              "response": {"status_code": 200, "request_id": f"req_{key}", "body": body},
              "error": None}
    if payload.metadata is not None:
        record["metadata"] = payload.metadata
    return record


def _sample_choice(sample: RequestOutput, index: int, payload: RequestPayload,
                   model_id: str) -> dict:
    """Sample `index` of n as its choice: the one choice its own reply would have."""
    choice = openai_output(sample, payload, model_id)["response"]["body"]["choices"][0]
    return {**choice, "index": index}


def _token_bytes(entry: dict) -> list[int]:
    """The token's own bytes (the engine's entry has them: a token holding part of a multi-byte
    character has no text of its own); else its text's."""
    raw = entry.get("bytes")
    return list(raw) if raw is not None else list(entry["token"].encode("utf-8", "replace"))


def _server(logprob: float) -> float:
    """-inf (a token a structured output's grammar refuses) as vLLM's server writes it."""
    return max(logprob, -9999.0)


def _chat_logprobs(entries: list[dict]) -> dict:
    return {"content": [{
        "token": e["token"], "logprob": _server(e["logprob"]), "bytes": _token_bytes(e),
        "top_logprobs": [{"token": t["token"], "logprob": _server(t["logprob"]),
                          "bytes": _token_bytes(t)} for t in e.get("top_logprobs", [])],
    } for e in entries]}


def _completion_logprobs(entries: list[dict]) -> dict:
    """The legacy completions form, as OpenAI and vLLM give it: each top_logprobs dict holds
    the sampled token too (up to logprobs + 1 entries), and text_offset is each token's start
    in the text, its tokens' lengths summed."""
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [_server(e["logprob"]) for e in entries],
            "top_logprobs": [{e["token"]: _server(e["logprob"]),
                              **{t["token"]: _server(t["logprob"])
                                 for t in e.get("top_logprobs", [])}}
                             for e in entries],
            "text_offset": offsets}


def _server_prompt_logprobs(entries: list) -> list:
    """vLLM's server form of prompt_logprobs (its `prompt_logprobs` request parameter): per
    position None or {token id: {logprob, rank, decoded_token}}, the prompt token first, then
    the top ones (a prompt token among them once, with its place in the top as rank); -inf
    written -9999.0, as its server clamps it."""
    def one(logprob: float, rank: int, token: str) -> dict:
        return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": token}

    out: list = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        position = {str(e["token_id"]): one(e["logprob"], e["rank"], e["token"])}
        for rank, t in enumerate(e["top_logprobs"], 1):
            position[str(t["token_id"])] = one(t["logprob"], rank, t["token"])
        out.append(position)
    return out


def error_record(line: int, code: str, message: str, request_id: Optional[str] = None,
                 metadata: Optional[dict] = None, custom_id: Optional[str] = None,
                 openai: bool = False) -> dict:
    record: dict[str, Any] = {"id": request_id, "line": line, "code": code, "message": message}
    if openai or custom_id is not None:
        # a repeated custom_id's record gets its own batch_req id, not the first line's
        key = _short_hash(f"{custom_id}:line-{line}" if code == "duplicate_id" and custom_id
                          else custom_id or f"line-{line}")
        record.update({"id": f"batch_req_{key}", "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}})
    if metadata is not None:
        record["metadata"] = metadata
    return record


def input_error_record(err: InputError, openai_input: bool) -> dict:
    return error_record(err.line, err.code, err.message, err.request_id, err.metadata,
                        err.custom_id, openai=openai_input)


def record_id(record: dict) -> Optional[str]:
    """The request id a record in outputs.jsonl answers (custom_id for the OpenAI envelope)."""
    if "custom_id" in record and "response" in record:
        return record.get("custom_id")
    return record.get("id")
