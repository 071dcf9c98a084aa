"""A conversation shaped for the chat template it is rendered with, as vLLM 0.32 shapes it.

Two things vLLM decides from the template's text before rendering:
- **content format** (vllm/renderers/hf.py `_detect_content_format`): a template that loops over
  a message's content (Gemma 3's: `{% for item in message['content'] %}`) gets every content as
  a list of `{"type": "text", "text": ...}` parts, a string content as one such part; any other
  template gets strings, several parts joined one a line (runner/io/input_records.py joins
  them). Found from the template's Jinja syntax tree, as vLLM finds it.
- **the developer role** (OpenAI's newer name for system instructions): where the template
  never names "developer", developer messages become system ones, and every system message is
  merged into one at the start (their texts joined by a blank line) — templates like Qwen's
  refuse a system message past the first.
"""
from __future__ import annotations

import functools
import logging
from collections import deque
from typing import Iterator, Optional

log = logging.getLogger("batchinfer")


def shape_conversation(messages: list[dict], template: str,
                       parts: Optional[list[Optional[list[str]]]] = None) -> list[dict]:
    """`messages` (contents as strings) for rendering with `template`, in vLLM's order: contents
    as parts for a template that takes them, then the developer role. `parts`: per message, its
    content's text parts as the line gave them (None where it gave a string)."""
    if content_format(template) == "openai":
        messages = [{**msg, "content": [
            {"type": "text", "text": t}
            for t in (parts[i] if parts is not None and parts[i] is not None
                      else [msg["content"]])]} for i, msg in enumerate(messages)]
    if any(m.get("role") == "developer" for m in messages) and not _names_developer(template):
        messages = _developer_as_system(messages)
    return messages


def _names_developer(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


def _developer_as_system(messages: list[dict]) -> list[dict]:
    log.info("the chat template has no 'developer' role: developer messages are rendered as "
             "system ones (as vLLM does)")
    converted = [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}
                 if m.get("role") == "developer" else m for m in messages]
    systems = [i for i, m in enumerate(converted) if m.get("role") == "system"]
    if systems == [0]:
        return converted
    texts = [_text(converted[i]["content"]) for i in systems]
    rest = [m for m in converted if m.get("role") != "system"]
    return [{"role": "system", "content": "\n\n".join(t for t in texts if t)}, *rest]


def _text(content) -> str:
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
    return content or ""


@functools.lru_cache(maxsize=32)
def content_format(template: str) -> str:
    """"openai" where the template iterates over a message's content, else "string"; a template
    whose syntax tree cannot be read counts as "string" (vLLM's default there too)."""
    import jinja2.nodes as nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        tree = _compile_jinja_template(template).environment.parse(template)
        next(_content_loops(tree, nodes))
    except StopIteration:
        return "string"
    except Exception as exc:  # noqa: BLE001 - the render itself reports a broken template
        log.debug("could not read the chat template's syntax tree: %s", exc)
        return "string"
    return "openai"


# --- the syntax-tree walk (vLLM 0.32's, in its own words) -------------------------------------

def _is_name(node, name: str, nodes) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_key_of(node, name: str, key: str, nodes) -> bool:
    """`name['key']` or `name.key`."""
    if isinstance(node, nodes.Getitem):
        return (_is_name(node.node, name, nodes) and isinstance(node.arg, nodes.Const)
                and node.arg.value == key)
    if isinstance(node, nodes.Getattr):
        return _is_name(node.node, name, nodes) and node.attr == key
    return False


def _reads(node, name: str, nodes, key: Optional[str] = None) -> bool:
    """`node` reads `name` (or its `key`) through filters, tests and slices."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _reads(node.node, name, nodes, key)
    if isinstance(node, nodes.Test):
        return _reads(node.node, name, nodes, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, nodes, key)
    return _is_key_of(node, name, key, nodes) if key else _is_name(node, name, nodes)


def _aliases(tree, name: str, nodes) -> Iterator[str]:
    """`name` and every variable assigned from it (`{% set msgs = messages[1:] %}`), transitively."""
    yield name
    seen, queue = {name}, deque([name])
    while queue:
        current = queue.popleft()
        for assign in tree.find_all(nodes.Assign):
            if isinstance(assign.target, nodes.Name) and _reads(assign.node, current, nodes):
                alias = assign.target.name
                if alias not in seen:
                    seen.add(alias)
                    queue.append(alias)
                    yield alias


def _message_names(tree, nodes) -> list[str]:
    """Loop variables of `{% for message in messages %}` loops (over any alias of messages)."""
    names = list(_aliases(tree, "messages", nodes))
    return [loop.target.name for loop in tree.find_all(nodes.For)
            if isinstance(loop.target, nodes.Name)
            and any(_reads(loop.iter, name, nodes) for name in names)]


def _content_loops(tree, nodes) -> Iterator:
    """Loops over a message's content: `for x in message['content']`, over a macro parameter
    that a call passes message.content to, or over a variable named `content` outside macros."""
    messages = _message_names(tree, nodes)
    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in tree.find_all(nodes.Macro):
        names = [arg.name for arg in macro.args]
        params: set[str] = set()
        for call in tree.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(names) and any(_reads(arg, m, nodes, "content") for m in messages):
                    params.add(names[i])
            for kwarg in call.kwargs:
                if kwarg.key in names and any(_reads(kwarg.value, m, nodes, "content")
                                              for m in messages):
                    params.add(kwarg.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in tree.find_all(nodes.For):
        if any(_reads(loop.iter, m, nodes, "content") for m in messages):
            yield loop
        elif isinstance(loop.iter, nodes.Name) and (
                loop.iter.name in params_by_loop.get(id(loop), ())
                or (id(loop) not in in_macros and loop.iter.name == "content")):
            yield loop
