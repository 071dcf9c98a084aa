"""The conversation of a chat line (`messages`), checked and shaped as vLLM 0.32 reads it:
roles and text content (OpenAI content parts of text kinds), lone surrogates refused, parts
joined for string templates or handed whole to templates that loop over them. Shared by the
generation and embedding jobs' input parsers."""
from __future__ import annotations

import re
from typing import Any, Optional

from batchinfer.engine.errors import RequestError


def json_type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str, key: str) -> Optional[str]:
    """What is wrong with `text` if it holds a lone UTF-16 surrogate (None: nothing). JSON's
    "\\ud800" escape decodes to one; it is no character, so no tokenizer can encode it. A
    pair ("\\ud83d\\ude00") decodes to its character."""
    found = _SURROGATE.search(text)
    if found is None:
        return None
    return (f"{key} holds a lone UTF-16 surrogate (U+{ord(found.group()):04X}) at character "
            f"{found.start()}; text must be valid Unicode")


def messages_text_problem(messages: list[dict], key: str) -> Optional[str]:
    """lone_surrogate over a checked conversation's roles and text."""
    for i, msg in enumerate(messages):
        for name in ("role", "content"):
            value = msg.get(name)
            if isinstance(value, str):
                problem = lone_surrogate(value, f"{key}[{i}].{name}")
                if problem:
                    return problem
    return None


def check_messages(messages: Any, key: str = "messages") -> Optional[str]:
    """None if `messages` is a usable conversation, else what is wrong with it."""
    if not isinstance(messages, list):
        return f"'{key}' must be an array of {{role, content}} objects, not {json_type_name(messages)}"
    if not messages:
        return f"'{key}' is empty"
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            return f"{key}[{i}] must be an object with role and content, not {json_type_name(msg)}"
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not role:
            return f"{key}[{i}].role must be a non-empty string"
        if isinstance(content, list):  # OpenAI content parts: only text is supported
            for j, part in enumerate(content):
                if _part_text(part) is _NOT_TEXT:
                    return (f"{key}[{i}].content[{j}]: only text parts are supported ({{type: "
                            f"text, text}}, or input_text / output_text / refusal / thinking)")
        elif not isinstance(content, str) and not (content is None and role == "assistant"):
            # null: an assistant turn that only called tools (OpenAI's API allows it there)
            return f"{key}[{i}].content must be a string or text parts, not {json_type_name(content)}"
    return None


# a content part's type -> the key holding its text, as vLLM 0.32 reads text parts (the
# Responses API's input_text / output_text, an assistant's refusal and thinking)
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text",
               "refusal": "refusal", "thinking": "thinking"}
_NOT_TEXT = object()


def _part_text(part: Any) -> Any:
    """A content part's text; None for a text part without any (vLLM skips it with a warning);
    _NOT_TEXT for anything else (an image, a malformed part)."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
        return _NOT_TEXT
    text = part.get(_TEXT_PARTS[part["type"]])
    return text if text is None or isinstance(text, str) else _NOT_TEXT


def content_parts(messages: list[dict]) -> Optional[list[Optional[list[str]]]]:
    """Per message, the texts of its content parts (a part without text skipped, an empty one
    kept, as vLLM hands parts to a template); None where no message gave parts."""
    if not any(isinstance(msg.get("content"), list) for msg in messages):
        return None
    return [[t for t in map(_part_text, msg["content"]) if t is not None]
            if isinstance(msg.get("content"), list) else None for msg in messages]


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Text content parts joined into one string, one part a line, as vLLM joins them for a chat
    template that takes its content as a string (every text model's here but Gemma 3's); an
    assistant's content null (a turn that made only tool calls) is empty text, as vLLM reads it."""
    out = []
    for msg in messages:
        content = msg.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            # vLLM drops empty parts too (a part's text is joined only when non-empty)
            content = "\n".join(text for text in map(_part_text, content) if text)
        out.append({**msg, "content": content})
    return out


_NO_TEMPLATE_ADVICE = {
    "/v1/embeddings": "send body.input as text or token ids instead of a conversation",
    "/v1/chat/completions": "send the line to /v1/completions with body.prompt instead",
}


def no_chat_template_for_line(exc: RequestError, openai_url: Optional[str]) -> RequestError:
    """The tokenizer's no_chat_template error with advice in the line's own form: its wording
    ("send 'prompt' instead of 'messages'") fits a plain line, not an OpenAI body."""
    advice = _NO_TEMPLATE_ADVICE.get(openai_url or "")
    if exc.code != "no_chat_template" or advice is None:
        return exc
    return RequestError(exc.code, f"{exc.message.split(';')[0]}; {advice}, or give one as "
                        "model.chat_template")
