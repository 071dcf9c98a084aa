"""An embedding job's checked spec -> an EmbeddingRequest (tokenized, truncated as vLLM's
pooling requests are), and its result -> the record on disk:

    plain / chat: {"id", "embedding": [...], "prompt_tokens": n, "metadata"?}
    OpenAI batch: the batch output envelope around vLLM's / OpenAI's embeddings response,
                  {"object": "list", "data": [{"object": "embedding", "embedding", "index"}],
                   "model", "usage": vLLM's UsageInfo}, one data entry per input
"""
from __future__ import annotations

import base64
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from batchinfer.engine.embedding.request import EmbeddingOutput, EmbeddingRequest
from batchinfer.engine.errors import RequestError

from .chat_messages import no_chat_template_for_line
from .embed_inputs import INPUTS, OPTIONS
from .input_records import RequestSpec
from .records import RequestPayload, _short_hash, openai_response_line


@dataclass
class EmbedPayload(RequestPayload):
    encoding_format: str = "float"      # OpenAI lines: float or base64
    embed_dtype: str = "float32"        # base64's value type and byte order (vLLM's extras)
    endianness: str = "native"


def _truncated(ids: list[int], keep: Optional[int], side: str) -> list[int]:
    if keep is None or keep >= len(ids):
        return ids
    return ids[len(ids) - keep:] if side == "left" else ids[:keep]     # (ids[-0:] is all)


def input_token_ids(spec: RequestSpec, tokenizer, max_model_len: int,
                    chat_template: str = "auto") -> list[list[int]]:
    """Each input's prompt token ids. truncate_prompt_tokens (-1: max_model_len) keeps that
    many tokens as vLLM 0.32's pooling requests do (renderers/params.py TokenizeParams): text
    through the tokenizer's own truncation (special tokens kept), token ids and conversations
    cut on the right (the pooling runner's side); a request's truncation_side instead cuts the
    whole token ids, text too, on that side (its special tokens are tokens like any other)."""
    options = spec.extra.get(OPTIONS, {})
    keep = options.get("truncate_prompt_tokens")
    if keep is not None and keep > max_model_len:
        raise RequestError("invalid_parameter", f"truncate_prompt_tokens={keep} cannot be "
                           f"greater than max_model_len = {max_model_len}")
    if keep == -1:
        keep = max_model_len
    special = options.get("add_special_tokens", True)
    hf = tokenizer.hf
    asked_side = options.get("truncation_side")
    side = asked_side or "right"
    out = []
    try:
        for value in spec.extra[INPUTS]:
            if isinstance(value, dict):   # a conversation (embed_inputs._conversation)
                if chat_template == "never":
                    from .admission import render_plain

                    text = render_plain(value["messages"], **spec.chat_options)
                    ids = list(hf.encode(text, add_special_tokens=True))
                else:
                    # vLLM's embeddings chat request: add_special_tokens defaults to false
                    try:
                        ids = tokenizer.apply_chat_template(
                            value["messages"], parts=value["parts"],
                            add_special_tokens=options.get("add_special_tokens", False),
                            **spec.chat_options)
                    except RequestError as exc:
                        raise no_chat_template_for_line(exc, spec.openai_url) from None
                out.append(_truncated(ids, keep, side))
            elif isinstance(value, str):
                if keep is not None and asked_side is None:
                    # the tokenizer's truncation (right: embedding_source sets it), then cut as
                    # token ids: the tokenizer keeps all when keep is under its special tokens'
                    # count (vLLM cuts after tokenizing too)
                    out.append(_truncated(list(hf.encode(value, add_special_tokens=special,
                                                         truncation=True, max_length=keep)),
                                          keep, side))
                else:
                    out.append(_truncated(list(hf.encode(value, add_special_tokens=special)),
                                          keep, side))
            else:
                out.append(_truncated(list(value), keep, side))
    except RequestError:
        raise
    except Exception as exc:   # the tokenizer rejects the text
        raise RequestError("tokenization_failed", f"the tokenizer could not encode the prompt: "
                           f"{type(exc).__name__}: {exc}") from None
    if options.get("padding") == "max_length":
        out = [_padded(ids, max_model_len, hf) for ids in out]
    return out


def _padded(ids: list[int], length: int, hf) -> list[int]:
    """vLLM's padding max_length: pad tokens appended up to max_model_len after truncation, real
    tokens of the prompt (attended, pooled, counted in its usage)."""
    if len(ids) >= length:
        return ids
    if hf.pad_token_id is None:
        raise RequestError("invalid_parameter", "padding=max_length: this model's tokenizer "
                           "has no pad token; leave padding unset")
    return ids + [hf.pad_token_id] * (length - len(ids))


def build_embed_request(spec: RequestSpec, tokenizer, order: int, max_model_len: int,
                        chat_template: str = "auto") -> EmbeddingRequest:
    options = spec.extra.get(OPTIONS, {})
    payload = EmbedPayload.from_spec(spec, order)
    payload.encoding_format = options.get("encoding_format", "float")
    payload.embed_dtype = options.get("embed_dtype", "float32")
    payload.endianness = options.get("endianness", "native")
    return EmbeddingRequest(
        request_id=spec.request_id,
        inputs=input_token_ids(spec, tokenizer, max_model_len, chat_template),
        dimensions=options.get("dimensions"), use_activation=options.get("use_activation"),
        payload=payload, arrival_index=order,
        prompt=spec.prompt if isinstance(spec.prompt, str) else None)


_BASE64_DTYPES = {"float32": (torch.float32, torch.float32),
                  "float16": (torch.float16, torch.float16),
                  "bfloat16": (torch.bfloat16, torch.int16),
                  "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
                  "fp8_e5m2": (torch.float8_e5m2, torch.uint8)}


def _encoded(vector: list[float], fmt: str, embed_dtype: str = "float32",
             endianness: str = "native") -> Any:
    """base64: the values' bytes as vLLM's server writes them (tensor2binary): cast to
    embed_dtype (float32 by default, as OpenAI's client decodes it), in the host's byte order
    unless endianness says another."""
    if fmt != "base64":
        return vector
    dtype, view = _BASE64_DTYPES[embed_dtype]
    array = torch.tensor(vector, dtype=torch.float32).to(dtype).view(view).numpy()
    if endianness not in ("native", sys.byteorder):
        array = array.byteswap()
    return base64.b64encode(array.tobytes()).decode("ascii")


def embedding_record(out: EmbeddingOutput, payload: RequestPayload, model_id: str) -> dict:
    if payload.openai_url:
        return openai_embedding_output(out, payload, model_id)
    record: dict[str, Any] = {"id": out.request_id, "embedding": out.embeddings[0],
                              "prompt_tokens": out.num_prompt_tokens}
    if payload.metadata is not None:
        record["metadata"] = payload.metadata
    return record


def embedding_usage(prompt_tokens: int) -> dict:
    """vLLM 0.32's UsageInfo as its run_batch writes it (model_dump_json: every field, nulls
    included): prompt tokens of all the line's inputs, completion_tokens 0."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
            "completion_tokens": 0, "prompt_tokens_details": None,
            "completion_tokens_details": None}


def openai_embedding_output(out: EmbeddingOutput, payload: RequestPayload,
                            model_id: str) -> dict:
    key = _short_hash(payload.custom_id or out.request_id)
    fmt = getattr(payload, "encoding_format", "float")
    encoding = (getattr(payload, "embed_dtype", "float32"), getattr(payload, "endianness",
                                                                     "native"))
    body = {
        "id": f"embd-{key}",
        "object": "list",
        "created": int(time.time()),
        "model": payload.openai_model or model_id,
        "data": [{"index": i, "object": "embedding",
                  "embedding": _encoded(vector, fmt, *encoding)}
                 for i, vector in enumerate(out.embeddings)],
        "usage": embedding_usage(out.num_prompt_tokens),
    }
    return openai_response_line(key, payload, body)
