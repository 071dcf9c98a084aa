"""Input records of an embedding job (`model.task: embed`) -> request specs, or input errors.

    plain   {"prompt": "..." | [token ids], "id"?, "metadata"?, "dimensions"?,
             "use_activation"?, "truncate_prompt_tokens"?, "truncation_side"?, "padding"?}
    chat    {"messages": [...], ...}: rendered by the chat template without the generation
            prompt (vLLM's embeddings chat request: add_generation_prompt false)
    OpenAI  {"custom_id", "method": "POST", "url": "/v1/embeddings",
             "body": {"input": "..." | ["...", ...] | [ids] | [[ids], ...] | [messages]
                               | [[messages], ...],
                      "model"?, "dimensions"?, "encoding_format"?: float | base64, "user"?,
                      "embed_dtype"?, "endianness"? (base64's, as vLLM's),
                      "use_activation"?, "truncate_prompt_tokens"?, "truncation_side"?,
                      "padding"?, "add_special_tokens"?}}
            (or body.messages: a conversation or a list of them, vLLM's batched chat
            request); one line, one record, one embedding per input.

Sampling keys ask for nothing an embedding does: a plain line or the recipe that sets one is
refused naming it (vLLM's LLM.embed takes no sampling parameters); in an OpenAI body, where
vLLM's server ignores keys it does not know, they are ignored with one warning per key and job
(the job's InputReader holds the keys said; each job of a process says its own).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from batchinfer.engine.request import SAMPLING_KEYS

from .chat_options import CHAT_OPTION_KEYS, chat_options
from .chat_messages import (check_messages, content_parts, json_type_name, lone_surrogate,
                            normalize_messages)
from .input_records import InputError, Parsed, RequestSpec, _is_token_ids, _request_id, openai_line

log = logging.getLogger("batchinfer")

EMBED_URL = "/v1/embeddings"
# what RequestSpec.extra carries for an embedding request
INPUTS, OPTIONS = "embed_inputs", "embed_options"
EMBED_OPTION_KEYS = frozenset({"dimensions", "use_activation", "truncate_prompt_tokens",
                               "truncation_side", "padding"})
TRUNCATION_SIDES = ("left", "right")
PADDINGS = ("max_length", "do_not_pad")     # vLLM's: max_length pads to max_model_len
PLAIN_KEYS = frozenset({"id", "prompt", "messages", "metadata"}) | EMBED_OPTION_KEYS \
    | CHAT_OPTION_KEYS
BODY_KEYS = frozenset({"input", "messages", "model", "user", "encoding_format",
                       "embed_dtype", "endianness", "add_special_tokens"}) | EMBED_OPTION_KEYS | CHAT_OPTION_KEYS
ENCODING_FORMATS = ("float", "base64")
# vLLM's base64 extras: the values' dtype and byte order (native: the host's)
EMBED_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
ENDIANNESS = ("native", "big", "little")


def _options(record: dict, where: str) -> tuple[dict, Optional[str]]:
    """dimensions / use_activation / truncate_prompt_tokens checked (null: the default)."""
    options: dict[str, Any] = {}
    for key in ("dimensions", "truncate_prompt_tokens"):
        value = record.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            return {}, f"{where}{key} must be a whole number, not {json_type_name(value)}"
        low = 1 if key == "dimensions" else -1
        if value < low:
            return {}, (f"{where}{key} must be at least {low}"
                        + (" (-1: the model's max_model_len)" if low < 0 else "")
                        + f", got {value}")
        options[key] = value
    for key, allowed in (("truncation_side", TRUNCATION_SIDES), ("padding", PADDINGS)):
        value = record.get(key)
        if value is not None and value not in allowed:
            return {}, f"{where}{key} must be one of {', '.join(allowed)}, not {value!r}"
        if value is not None:
            options[key] = value
    if record.get("use_activation") is not None:
        if not isinstance(record["use_activation"], bool):
            return {}, f"{where}use_activation must be true or false"
        options["use_activation"] = record["use_activation"]
    return options, None


def _unknown(keys: set, allowed: frozenset, where: str) -> Optional[str]:
    unknown = sorted(keys - allowed)
    if not unknown:
        return None
    sampling = [k for k in unknown if k in SAMPLING_KEYS]
    if sampling:
        return (f"{where}{sampling[0]}: an embedding job (model.task: embed) does not sample; "
                f"allowed keys: {', '.join(sorted(allowed))}")
    return (f"unknown key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(where + repr(k) for k in unknown)} for an embedding job (model.task: "
            f"embed); allowed: {', '.join(sorted(allowed))}")


def _conversation(messages: Any, key: str) -> tuple[Optional[dict], Optional[tuple[str, str]]]:
    """One checked conversation as an INPUTS entry ({"messages", "parts"}), or (code, message)."""
    problem = check_messages(messages, key)
    if problem:
        return None, ("invalid_messages", problem)
    normalized = normalize_messages(messages)
    for i, msg in enumerate(normalized):
        if isinstance(msg.get("content"), str):
            problem = lone_surrogate(msg["content"], f"{key}[{i}].content")
            if problem:
                return None, ("invalid_text", problem)
    return {"messages": normalized, "parts": content_parts(messages)}, None


def _chat(spec: RequestSpec, conversations: list, record: dict, key: str, where: str,
          batched: bool = False) -> Optional[tuple[str, str]]:
    """Fills spec.extra[INPUTS] with the conversations (spec.messages: the first) and
    spec.chat_options, shared by all as vLLM's batched chat request shares them; (code, message)
    when one is not a conversation."""
    inputs = []
    for i, messages in enumerate(conversations):
        conversation, problem = _conversation(messages, f"{key}[{i}]" if batched else key)
        if problem:
            return problem
        inputs.append(conversation)
    spec.messages, spec.content_parts = inputs[0]["messages"], inputs[0]["parts"]
    spec.extra[INPUTS] = inputs                  # rendered at admission
    # vLLM's embeddings chat request: no generation prompt unless the line asks for one
    spec.chat_options, problem = chat_options({"add_generation_prompt": False, **{
        k: v for k, v in record.items() if k in CHAT_OPTION_KEYS and v is not None}}, where)
    if problem:
        return "invalid_chat_options", problem
    return None


def _text_or_ids(value: Any, key: str) -> tuple[Any, Optional[tuple[str, str]]]:
    """One input: text (non-empty, valid Unicode) or token ids."""
    if isinstance(value, str):
        if not value:   # vLLM 0.32 would embed the special tokens alone ([CLS] [SEP])
            return None, ("empty_prompt", f"{key} is empty: give text (a non-empty string) or "
                          "token ids; an empty text is not embedded")
        problem = lone_surrogate(value, key)
        return (None, ("invalid_text", problem)) if problem else (value, None)
    if _is_token_ids(value):
        return list(value), None
    if isinstance(value, list) and not value:
        return None, ("empty_prompt", f"{key} is an empty array")
    return None, ("invalid_type", f"{key} must be a string or an array of token ids, not "
                  f"{json_type_name(value)}")


def parse_embed_plain(record: Any, line: int, id_prefix: str = "line-",
                      columns: Optional[tuple[str, str]] = None) -> Parsed:
    """A plain or chat line of an embedding job (or a dataset row made into one: `columns`)."""
    if not isinstance(record, dict):
        return InputError(line, "not_an_object", f"a request must be a JSON object, not "
                          f"{json_type_name(record)}")
    rid = _request_id(record.get("id"), line, id_prefix)
    if isinstance(rid, InputError):
        return rid
    metadata = record.get("metadata")
    err = lambda code, msg: InputError(line, code, msg, request_id=rid,  # noqa: E731
                                       metadata=metadata if isinstance(metadata, dict) else None)
    if metadata is not None and not isinstance(metadata, dict):
        return err("invalid_type", f"'metadata' must be an object, not {json_type_name(metadata)}")
    problem = _unknown(set(record), PLAIN_KEYS, "")
    if problem:
        code = "unsupported_parameter" if "does not sample" in problem else "unknown_key"
        return err(code, problem)
    names = ({"prompt": "'prompt'", "messages": "'messages'"} if columns is None else
             {"prompt": f"column '{columns[0]}' (io.prompt_field)",
              "messages": f"column '{columns[1]}' (io.messages_field)"})
    has_prompt, has_messages = "prompt" in record, "messages" in record
    if has_prompt == has_messages:
        return err("missing_prompt" if not has_prompt else "ambiguous_request",
                   f"a request needs exactly one of {names['prompt']} (text or token ids) or "
                   f"{names['messages']} (chat)")
    spec = RequestSpec(line=line, request_id=rid, metadata=metadata)
    options, problem = _options(record, "")
    if problem:
        return err("invalid_parameter", problem)
    if has_prompt:
        keys = sorted(k for k in CHAT_OPTION_KEYS & record.keys() if record[k] is not None)
        if keys:
            return err("invalid_chat_options", f"'{keys[0]}' applies to a chat request "
                       "('messages'); a 'prompt' is embedded as written")
        value, problem = _text_or_ids(record["prompt"], names["prompt"])
        if problem:
            return err(*problem)
        spec.prompt = value
        spec.extra[INPUTS] = [value]
    else:
        problem = _chat(spec, [record["messages"]], record,
                        "messages" if columns is None else columns[1], "")
        if problem:
            return err(*problem)
    spec.extra[OPTIONS] = options
    return spec


def parse_embed_row(row: dict, line: int, prompt_field: str, messages_field: str,
                    id_field: str, metadata_fields: list[str], blank_is_null: bool = False
                    ) -> Parsed:
    """A dataset row of an embedding job: the configured columns, others ignored."""
    record: dict[str, Any] = {}
    if row.get(id_field) is not None:
        record["id"] = row[id_field]
    if row.get(messages_field) is not None:
        record["messages"] = row[messages_field]
    elif prompt_field in row:
        record["prompt"] = "" if blank_is_null and row[prompt_field] is None else row[prompt_field]
    if metadata_fields:
        record["metadata"] = {k: row.get(k) for k in metadata_fields}
    parsed = parse_embed_plain(record, line, "row-", (prompt_field, messages_field))
    if isinstance(parsed, InputError) and parsed.code == "missing_prompt":
        parsed.message = (f"the row has neither a '{prompt_field}' nor a '{messages_field}' "
                          f"value (columns: {', '.join(map(str, row))}); set io.prompt_field or "
                          "io.messages_field")
    return parsed


def _is_chat_messages(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value))


def _is_batched_chat(value: Any) -> bool:
    """Several conversations (vLLM's batched chat request, in body.messages or body.input)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(c, list) and bool(c) and all(isinstance(m, dict) for m in c)
                    for c in value))


def parse_embed_openai(record: Any, line: int, warned: Optional[set] = None) -> Parsed:
    """An OpenAI batch line of an embedding job (url /v1/embeddings); `warned`: the ignored
    body keys this job has warned of (None: warn of each)."""
    checked = openai_line(record, line, (EMBED_URL,), lambda url: f"url {url!r}: this is an "
                          f"embedding job (model.task: embed), whose lines go to {EMBED_URL}")
    if isinstance(checked, InputError):
        return checked
    custom_id, url, metadata, body, err = checked
    ignored = sorted(set(body) - BODY_KEYS)
    warned = set() if warned is None else warned
    fresh = [k for k in ignored if k not in warned]
    if fresh:
        warned.update(fresh)
        log.warning("line %d: body key(s) %s are ignored: they do not change an embedding "
                    "(vLLM's server ignores keys it does not know; its priority, request_id and "
                    "cache_salt only schedule or name a request); said once per key and job",
                    line, ", ".join(fresh))
    spec = RequestSpec(line=line, request_id=custom_id, custom_id=custom_id, openai_url=url,
                       metadata=metadata, extra={"model": body.get("model")})
    options, problem = _options(body, "body.")
    if problem:
        return err("invalid_parameter", problem)
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ENCODING_FORMATS:
        return err("invalid_parameter", f"body.encoding_format must be one of "
                   f"{', '.join(ENCODING_FORMATS)}, not {fmt!r}")
    options["encoding_format"] = fmt or "float"
    for key, allowed in (("embed_dtype", EMBED_DTYPES), ("endianness", ENDIANNESS)):
        value = body.get(key)
        if value is not None and value not in allowed:
            return err("invalid_parameter", f"body.{key} must be one of {', '.join(allowed)}, "
                       f"not {value!r}")
        if value is not None:
            options[key] = value
    if body.get("add_special_tokens") is not None:
        if not isinstance(body["add_special_tokens"], bool):
            return err("invalid_parameter", "body.add_special_tokens must be true or false")
        options["add_special_tokens"] = body["add_special_tokens"]
    spec.extra[OPTIONS] = options
    has_input, has_messages = body.get("input") is not None, body.get("messages") is not None
    if has_input == has_messages:
        return err("missing_prompt" if not has_input else "ambiguous_request",
                   "the body needs exactly one of body.input (text, texts, token ids or "
                   "conversations) or body.messages (a conversation, or a list of them)")
    value = body["messages"] if has_messages else body["input"]
    batched = _is_batched_chat(value)
    if has_messages or batched or _is_chat_messages(value):
        if body.get("chat_template") is not None:   # vLLM's server refuses it by default
            return err("unsupported_parameter", "body.chat_template: a line's own chat template "
                       "is refused, as vLLM's server refuses it without "
                       "--trust-request-chat-template; set model.chat_template in the recipe")
        key = "body.messages" if has_messages else "body.input"
        problem = _chat(spec, value if batched else [value], body, key, "body.", batched)
        if problem:
            return err(*problem)
        return spec
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        inputs = []
        for i, item in enumerate(value):
            one, problem = _text_or_ids(item, f"body.input[{i}]")
            if problem:
                return err(*problem)
            inputs.append(one)
    else:
        one, problem = _text_or_ids(value, "body.input")
        if problem:
            return err(*problem)
        inputs = [one]
    spec.prompt = inputs[0] if len(inputs) == 1 else None
    spec.extra[INPUTS] = inputs
    return spec
