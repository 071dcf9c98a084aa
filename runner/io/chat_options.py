"""vLLM's chat rendering options on a chat request: `add_generation_prompt`,
`continue_final_message` and `chat_template_kwargs`, with the names, defaults and rules of
vLLM's `LLM.chat` and of its OpenAI server's chat body.

Checked here without a tokenizer (`batchinfer validate` runs it); the tokenizer renders with
them (engine/tokenizer.Tokenizer.apply_chat_template).
"""
from __future__ import annotations

import json
from typing import Any, Optional

from batchinfer.engine.config import RESERVED_TEMPLATE_KWARGS

CHAT_OPTION_KEYS = frozenset({"add_generation_prompt", "continue_final_message",
                              "chat_template_kwargs"})


def chat_options(record: dict, where: str = "") -> tuple[dict, Optional[str]]:
    """(keyword arguments for Tokenizer.apply_chat_template, what is wrong or None) from the
    option keys of a chat line (`where`: how the line names their parent, e.g. "body."). A key
    set to null takes its default."""
    options: dict[str, Any] = {}
    for key in ("add_generation_prompt", "continue_final_message"):
        value = record.get(key)
        if value is None:
            continue
        if not isinstance(value, bool):
            return {}, f"{where}{key} must be true or false, not {json.dumps(value, default=repr)}"
        options[key] = value
    if options.get("continue_final_message") and options.get("add_generation_prompt", True):
        return {}, (f"{where}continue_final_message: true needs {where}add_generation_prompt: "
                    "false (its default is true): a reply either continues the last message or "
                    "starts a new one, as in vLLM")
    kwargs = record.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            return {}, (f"{where}chat_template_kwargs must be an object of template variables, "
                        f"not {json.dumps(kwargs, default=repr)}")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            own = [k for k in reserved if k in CHAT_OPTION_KEYS]
            return {}, (f"{where}chat_template_kwargs.{reserved[0]} is not a template variable "
                        "but a rendering option" + (f": set {where}{own[0]} on the line itself"
                                                    if own else " batchinfer sets itself"))
        if kwargs:
            options["template_kwargs"] = dict(kwargs)
    return options, None


def misplaced_chat_options(record: dict) -> Optional[str]:
    """What is wrong when a request that is not a conversation sets a chat option, or None."""
    keys = sorted(k for k in CHAT_OPTION_KEYS & record.keys() if record[k] is not None)
    if not keys:
        return None
    return (f"'{keys[0]}' applies to a chat request ('messages'); a 'prompt' is sent as "
            "written")
