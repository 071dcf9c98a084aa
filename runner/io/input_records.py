"""One input record (a parsed JSON line or a dataset row) -> a request spec, or an input error.

Three shapes:
- plain  {"prompt": "...", "id"?, "metadata"?, <sampling keys>}
- chat   {"messages": [{"role", "content"}, ...], "id"?, "metadata"?, <sampling keys>}
- OpenAI Batch API {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
  "body": {...}}; body keys map onto vLLM sampling parameters.
Nothing here tokenizes or touches the engine: specs are checked for shape, types and sampling
ranges, so `batchinfer validate` runs it without a model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, NamedTuple, Optional, Union

from pydantic import ValidationError

from ..recipe_errors import dotted, quoted_with_hints
from .chat_messages import (check_messages, content_parts, json_type_name, lone_surrogate,
                            messages_text_problem, normalize_messages)
from .chat_options import CHAT_OPTION_KEYS, chat_options, misplaced_chat_options
from .structured_outputs import merge_response_format, removed_guided_key
from batchinfer.engine.request import (SAMPLING_KEYS, VLLM_KEYS_NOT_IMPLEMENTED, SamplingParams,
                                       not_implemented_problem)

OPENAI_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# OpenAI body keys accepted without effect on generation
OPENAI_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options",
                  "parallel_tool_calls"}
OPENAI_UNSUPPORTED = {"tools", "tool_choice", "functions", "function_call", "best_of", "echo",
                      "suffix", "audio", "modalities", "prediction", "reasoning_effort",
                      "web_search_options"}
# what each of those means when a batch file states it: the default, so the line runs (SDKs and
# scripts write them out); any other value asks for what batchinfer does not do
OPENAI_STATED_DEFAULTS = {"tools": [], "tool_choice": "none", "functions": [],
                          "function_call": "none", "best_of": 1, "echo": False, "suffix": "",
                          "modalities": ["text"]}
RECORD_KEYS = {"id", "prompt", "messages", "metadata", "lora"}   # lora: admission.request_lora
_PLAIN_KEYS = frozenset(RECORD_KEYS | SAMPLING_KEYS | CHAT_OPTION_KEYS)


@dataclass
class InputError:
    """A record that cannot become a request; written to errors.jsonl with its line number."""

    line: int
    code: str
    message: str
    request_id: Optional[str] = None
    custom_id: Optional[str] = None
    metadata: Optional[dict] = None
    openai_url: Optional[str] = None


@dataclass
class RequestSpec:
    """A checked request before tokenization."""

    line: int
    request_id: str
    prompt: Union[str, list[int], None] = None          # text, or token ids (OpenAI completions)
    messages: Optional[list[dict]] = None
    sampling: Optional[SamplingParams] = None            # defaults + this record's overrides
    metadata: Optional[dict] = None
    custom_id: Optional[str] = None                      # OpenAI input only
    openai_url: Optional[str] = None                     # OpenAI input only
    extra: dict = field(default_factory=dict)
    # the sampling keys this record set itself; the others are the recipe's (sampling.*)
    sampling_keys: frozenset = frozenset()
    # vLLM's chat options a chat line set (runner/io/chat_options.py), for apply_chat_template
    chat_options: dict = field(default_factory=dict)
    # per message, its content's text parts where the line gave parts (else None); None: no
    # message did. For chat templates that take parts (Gemma 3's: engine/chat_format.py)
    content_parts: Optional[list[Optional[list[str]]]] = None

    @property
    def is_openai(self) -> bool:
        return self.openai_url is not None


Parsed = Union[RequestSpec, InputError]


def _sampling(line: int, rid: Optional[str], defaults: SamplingParams, overrides: dict,
              where: str, written: Optional[dict] = None) -> Union[SamplingParams, InputError]:
    """written: a sampling key -> the key the line spelled it with (OpenAI's names)."""
    if not overrides:
        return defaults
    try:
        return defaults.with_overrides(**overrides)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            key = dotted(err["loc"]) if err["loc"] else "sampling"     # stop_token_ids[1]
            key = (written or {}).get(key, key)
            msg = err["msg"].removeprefix("Value error, ")
            value = err.get("input")
            spelled = json.dumps(value, default=repr)        # as JSON spells it: true, null
            shown = ("" if isinstance(value, (dict, list)) or msg.endswith(f"not {spelled}")
                     else f" (got {spelled})")
            parts.append(f"{where}{key}: {msg}{shown}")
        return InputError(line, "invalid_sampling", "; ".join(parts), request_id=rid)


def _not_implemented(record: dict, where: str) -> Optional[str]:
    """The first of vLLM's sampling keys batchinfer does not implement that asks for something
    (a value other than vLLM's default), named as the line wrote it; None if none does."""
    for key in sorted(VLLM_KEYS_NOT_IMPLEMENTED.keys() & record.keys()):
        problem = not_implemented_problem(key, record[key])
        if problem:
            return where + problem
    return None


def _unknown_keys(keys: set, allowed: set, where: str) -> Optional[str]:
    unknown = sorted(keys - allowed)
    if not unknown:
        return None
    return (f"unknown key{'s' if len(unknown) > 1 else ''} "
            f"{quoted_with_hints(unknown, allowed, where)}; allowed: {', '.join(sorted(allowed))}")


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def _token_ids_problem(prompt: list, key: str) -> tuple[str, str]:
    """(code, message) for an array prompt that is not token ids."""
    if not prompt:
        return "empty_prompt", f"{key} is an empty array"
    index, item = next((i, t) for i, t in enumerate(prompt)
                       if not isinstance(t, int) or isinstance(t, bool))
    if all(isinstance(t, (list, str)) for t in prompt):
        return "invalid_type", f"{key} holds several prompts: one prompt per line"
    return "invalid_type", (f"{key} is an array, so token ids (whole numbers), but item {index} "
                            f"is {json.dumps(item, default=repr)}")


def _request_id(value: Any, line: int, fallback_prefix: str) -> Union[str, InputError]:
    if value is None:
        return f"{fallback_prefix}{line}"
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return InputError(line, "invalid_type", f"'id' must be a string or an integer, not "
                          f"{json_type_name(value)}")
    text = str(value)
    if not text:
        return InputError(line, "invalid_type", "'id' must not be empty")
    return text


def _metadata(value: Any, line: int, rid: Optional[str]) -> Union[dict, None, InputError]:
    if value is None or isinstance(value, dict):
        return value
    return InputError(line, "invalid_type", f"'metadata' must be an object, not {json_type_name(value)}",
                      request_id=rid)


def parse_plain_or_chat(record: Any, line: int, defaults: SamplingParams,
                        id_prefix: str = "line-", columns: Optional[tuple[str, str]] = None
                        ) -> Parsed:
    """A plain ({"prompt"}) or chat ({"messages"}) JSONL record. `columns`: a dataset row's
    prompt and messages columns (io.prompt_field, io.messages_field), which messages name."""
    name = {"prompt": "'prompt'", "messages": "'messages'"} if columns is None else {
        "prompt": f"column '{columns[0]}' (io.prompt_field)",
        "messages": f"column '{columns[1]}' (io.messages_field)"}
    if not isinstance(record, dict):
        return InputError(line, "not_an_object", f"a request must be a JSON object, not "
                          f"{json_type_name(record)}")
    rid = _request_id(record.get("id"), line, id_prefix)
    if isinstance(rid, InputError):
        return rid
    metadata = _metadata(record.get("metadata"), line, rid)
    if isinstance(metadata, InputError):
        return metadata
    err = lambda code, msg: InputError(line, code, msg, request_id=rid, metadata=metadata)  # noqa: E731
    if "prompt_token_ids" in record:     # the did-you-mean would offer stop_token_ids
        return err("unknown_key", "unknown key 'prompt_token_ids' (vLLM's TokensPrompt): give "
                   "the token ids as 'prompt', an array ([1, 2, 3])")
    if not _PLAIN_KEYS.issuperset(record) and (problem := removed_guided_key(record, "")):
        return err("unsupported_parameter", problem)
    unknown = None if _PLAIN_KEYS.issuperset(record) else _unknown_keys(
        set(record) - VLLM_KEYS_NOT_IMPLEMENTED.keys(), _PLAIN_KEYS, "")
    if unknown:
        return err("unknown_key", unknown)
    problem = _not_implemented(record, "")
    if problem:
        return err("unsupported_parameter", problem)
    has_prompt, has_messages = "prompt" in record, "messages" in record
    if has_prompt == has_messages:
        return err("missing_prompt" if not has_prompt else "ambiguous_request",
                   f"a request needs exactly one of {name['prompt']} (text) or "
                   f"{name['messages']} (chat)")
    spec = RequestSpec(line=line, request_id=rid, metadata=metadata, extra={"lora": record.get("lora")})
    if has_prompt:
        prompt = record["prompt"]
        if (problem := misplaced_chat_options(record)) is not None:
            return err("invalid_chat_options", problem)
        if _is_token_ids(prompt):
            spec.prompt = list(prompt)
        elif isinstance(prompt, list):
            return err(*_token_ids_problem(prompt, name["prompt"]))
        elif not isinstance(prompt, str):
            return err("invalid_type", f"{name['prompt']} must be a string or an array of "
                       f"token ids, not {json_type_name(prompt)}")
        elif not prompt:
            return err("empty_prompt", f"{name['prompt']} is empty")
        elif (problem := lone_surrogate(prompt, name["prompt"])) is not None:
            return err("invalid_text", problem)
        else:
            spec.prompt = prompt
    else:
        key = "messages" if columns is None else columns[1]
        problem = check_messages(record["messages"], key)
        if problem:
            return err("invalid_messages", problem)
        spec.messages = normalize_messages(record["messages"])
        spec.content_parts = content_parts(record["messages"])
        problem = messages_text_problem(spec.messages, key)
        if problem:
            return err("invalid_text", problem)
        spec.chat_options, problem = chat_options(record)
        if problem:
            return err("invalid_chat_options", problem)
    overrides = {k: v for k, v in record.items() if k in SAMPLING_KEYS}
    spec.sampling_keys = frozenset(overrides)
    sampling = _sampling(line, rid, defaults, overrides, "")
    if isinstance(sampling, InputError):
        sampling.metadata = metadata
        return sampling
    spec.sampling = sampling
    return spec


OPENAI_LINE_KEYS = {"custom_id", "method", "url", "body", "metadata"}
_OPENAI_SAMPLING = SAMPLING_KEYS - {"logprobs", "n"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _states_default(key: str, value: Any) -> bool:
    """`value` of an unsupported key is null or its default (OPENAI_STATED_DEFAULTS): nothing
    is asked that batchinfer does not do. Types compared too (`best_of: true` is no 1)."""
    if value is None:
        return True
    default = OPENAI_STATED_DEFAULTS.get(key, object())
    return type(value) is type(default) and value == default


class OpenAILine(NamedTuple):
    custom_id: str
    url: str
    metadata: Optional[dict]
    body: dict
    err: Callable[[str, str], InputError]      # (code, message) -> this line's error record


def openai_line(record: Any, line: int, urls: Collection[str],
                url_problem: Callable[[Any], str]) -> Union[OpenAILine, InputError]:
    """What every OpenAI batch line is checked for before its body (generation and embedding
    jobs alike): an object with a custom_id and known keys, an object metadata, POST, a url
    of `urls` (else url_problem(url) says what is allowed) and an object body."""
    if not isinstance(record, dict):
        return InputError(line, "not_an_object", f"a request must be a JSON object, not "
                          f"{json_type_name(record)}")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return InputError(line, "invalid_custom_id", "an OpenAI batch line needs 'custom_id', a "
                          "non-empty string")
    url = record.get("url")
    known_url = isinstance(url, str) and url in urls
    metadata = record.get("metadata") if isinstance(record.get("metadata"), dict) else None
    err = lambda code, msg: InputError(line, code, msg, request_id=custom_id,  # noqa: E731
                                       custom_id=custom_id, metadata=metadata,
                                       openai_url=url if known_url else None)
    unknown = _unknown_keys(set(record), OPENAI_LINE_KEYS, "")
    if unknown:
        return err("unknown_key", unknown)
    if record.get("metadata") is not None and metadata is None:
        return err("invalid_type", "'metadata' must be an object")
    if record.get("method") != "POST":
        return err("unsupported_method", f"method {record.get('method')!r} is not supported; "
                   "OpenAI batch lines use POST")
    if not known_url:
        return err("unsupported_url", url_problem(url))
    body = record.get("body")
    if not isinstance(body, dict):
        return err("invalid_body", f"'body' must be an object, not {json_type_name(body)}")
    return OpenAILine(custom_id, url, metadata, body, err)


def parse_openai(record: Any, line: int, defaults: SamplingParams) -> Parsed:
    """An OpenAI Batch API input line."""
    checked = openai_line(record, line, OPENAI_URLS, lambda url: f"url {url!r} is not "
                          f"supported; supported: {', '.join(OPENAI_URLS)}")
    if isinstance(checked, InputError):
        return checked
    custom_id, url, metadata, body, err = checked
    chat = OPENAI_URLS[url] == "chat"
    input_key = "messages" if chat else "prompt"
    spec = RequestSpec(line=line, request_id=custom_id, custom_id=custom_id, openai_url=url,
                       metadata=metadata, extra={"model": body.get("model")})
    bad = sorted(k for k in set(body) & OPENAI_UNSUPPORTED if not _states_default(k, body[k]))
    if bad:
        return err("unsupported_parameter", f"body.{bad[0]} is not supported by batchinfer"
                   + (f" (only {json.dumps(OPENAI_STATED_DEFAULTS[bad[0]])}, the default)"
                      if bad[0] in OPENAI_STATED_DEFAULTS else ""))
    if body.get("stream"):
        return err("unsupported_parameter", "body.stream: streaming does not apply to batch jobs")
    allowed = {input_key, "stream", "max_tokens", "max_completion_tokens", "logprobs",
               "top_logprobs", "n", "response_format"} | OPENAI_IGNORED | OPENAI_UNSUPPORTED | \
        _OPENAI_SAMPLING
    if problem := removed_guided_key(body, "body."):
        return err("unsupported_parameter", problem)
    if chat:                # vLLM's server takes its chat options in the body
        allowed |= CHAT_OPTION_KEYS
    unknown = _unknown_keys(set(body) - VLLM_KEYS_NOT_IMPLEMENTED.keys(), allowed, "body.")
    if unknown:
        return err("unknown_key", unknown)
    problem = _not_implemented(body, "body.")
    if problem:
        return err("unsupported_parameter", problem)
    if input_key not in body:
        return err("missing_prompt", f"body.{input_key} is required for {url}")
    if chat:
        problem = check_messages(body["messages"], "body.messages")
        if problem:
            return err("invalid_messages", problem)
        spec.messages = normalize_messages(body["messages"])
        spec.content_parts = content_parts(body["messages"])
        problem = messages_text_problem(spec.messages, "body.messages")
        if problem:
            return err("invalid_text", problem)
        spec.chat_options, problem = chat_options(body, "body.")
        if problem:
            return err("invalid_chat_options", problem)
    else:
        prompt = body["prompt"]
        if _is_token_ids(prompt):
            spec.prompt = list(prompt)
        elif isinstance(prompt, list) and (not prompt or not all(isinstance(p, str)
                                                                 for p in prompt)):
            return err(*_token_ids_problem(prompt, "body.prompt"))
        elif isinstance(prompt, str):
            if not prompt:
                return err("empty_prompt", "body.prompt is empty")
            if (problem := lone_surrogate(prompt, "body.prompt")) is not None:
                return err("invalid_text", problem)
            spec.prompt = prompt
        else:
            return err("invalid_type", "body.prompt must be a string or an array of token ids "
                       "(one prompt per line)")
    overrides, problem, written = _openai_overrides(body, chat)
    if problem:
        return err("invalid_sampling", problem)
    if chat and "max_tokens" not in overrides and "max_tokens" not in defaults.model_fields_set:
        # as OpenAI's chat endpoint and vLLM's server read it: the rest of the context (the
        # completions endpoint's default is 16, as the recipe's; a recipe that sets one rules)
        overrides["max_tokens"] = None
    sampling = _sampling(line, custom_id, defaults, overrides, "body.", written)
    if isinstance(sampling, InputError):
        return err(sampling.code, sampling.message)
    spec.sampling = sampling
    spec.sampling_keys = frozenset(overrides)
    return spec


def _openai_overrides(body: dict, chat: bool) -> tuple[dict, Optional[str], dict]:
    """(sampling overrides, a problem or None, sampling key -> the body key it came from where
    the names differ). A key set to null means its default, as OpenAI reads it."""
    overrides = {k: body[k] for k in _OPENAI_SAMPLING if body.get(k) is not None}
    written: dict[str, str] = {}
    if isinstance(overrides.get("logit_bias"), dict):     # OpenAI's range, as vLLM's server
        overrides["logit_bias"] = {t: min(100.0, max(-100.0, b)) if _is_number(b) else b
                                   for t, b in overrides["logit_bias"].items()}
    if body.get("n") is not None:
        overrides["n"] = body["n"]
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            overrides["max_tokens"] = body[key]
            written["max_tokens"] = key
            break
    if chat:
        if body.get("logprobs"):        # top_logprobs absent or null: 0, the sampled token's
            top = body.get("top_logprobs")
            overrides["logprobs"] = 0 if top is None else top
            written["logprobs"] = "top_logprobs"
        elif "top_logprobs" in body and body["top_logprobs"]:
            return {}, "body.top_logprobs needs body.logprobs: true", written
    elif body.get("logprobs") is not None:
        if isinstance(body["logprobs"], bool) or not isinstance(body["logprobs"], int):
            return {}, "body.logprobs must be an integer for /v1/completions", written
        overrides["logprobs"] = body["logprobs"]
    problem = merge_response_format(overrides, body, written)   # structured_outputs
    return ({}, problem, written) if problem else (overrides, None, written)


def parse_dataset_row(row: dict, line: int, defaults: SamplingParams, prompt_field: str,
                      messages_field: str, id_field: str, metadata_fields: list[str],
                      blank_is_null: bool = False, lora_field: str = "lora") -> Parsed:
    """A dataset row: prompt or messages, the id and the LoRA adapter (an empty cell: none) from
    the configured columns, other columns ignored.
    blank_is_null: the reader turns an empty cell into null (CSV), so a null prompt is an empty
    one (empty_prompt, as parquet's "" is), not a value of the wrong type."""
    record: dict[str, Any] = {}
    if row.get(id_field) is not None:
        record["id"] = row[id_field]
    if row.get(messages_field) is not None:
        record["messages"] = row[messages_field]
    elif prompt_field in row:
        record["prompt"] = row[prompt_field]
        if blank_is_null and record["prompt"] is None:
            record["prompt"] = ""
    if row.get(lora_field) not in (None, ""):
        record["lora"] = row[lora_field]
    if metadata_fields:
        record["metadata"] = {k: row.get(k) for k in metadata_fields}
    parsed = parse_plain_or_chat(record, line, defaults, id_prefix="row-",
                                 columns=(prompt_field, messages_field))
    if isinstance(parsed, InputError) and parsed.code == "missing_prompt":
        parsed.message = (f"the row has neither a '{prompt_field}' nor a '{messages_field}' value "
                          f"(columns: {', '.join(map(str, row))}); set io.prompt_field or "
                          "io.messages_field")
    return parsed
