"""Turns YAML and pydantic problems into messages a user can act on.

Every message names the file, the line (when the key is in the file), the dotted key path and what
is allowed; an unknown key gets the closest valid one suggested (difflib).
"""
from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import yaml
from pydantic import BaseModel, ValidationError

from batchinfer.engine.errors import ConfigError

KeyPath = tuple[Union[str, int], ...]


class RecipeError(ConfigError):
    """A recipe that cannot run. `problems` are one-line messages, each naming a key path."""

    def __init__(self, source: str, problems: Sequence[str]):
        self.source = source
        self.problems = list(problems)
        head = f"{source}: {len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}"
        super().__init__(head + "".join(f"\n  - {p}" for p in self.problems))


# vLLM's names for keys a recipe spells otherwise (no spelling is close enough to find them)
VLLM_NAMES = {"tensor_parallel_size": "tp", "pipeline_parallel_size": "pp",
              "data_parallel_size": "dp"}


def suggest(word: str, choices: Iterable[str]) -> Optional[str]:
    """The closest valid spelling of `word` (or the key vLLM's name stands for), if one is
    close enough."""
    choices = list(choices)
    if VLLM_NAMES.get(str(word)) in choices:
        return VLLM_NAMES[str(word)]
    matches = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return matches[0] if matches else None


def quoted_with_hints(names: Iterable[str], choices: Iterable[str], prefix: str = "") -> str:
    """'name' (did you mean 'choice'?), ... for names that are not among `choices`."""
    choices = list(choices)
    out = []
    for name in names:
        hint = suggest(name, choices)
        out.append(f"'{prefix}{name}'" + (f" (did you mean '{hint}'?)" if hint else ""))
    return ", ".join(out)


def dotted(path: KeyPath) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


class YamlLines:
    """Key path -> line number in the YAML text, from the composed node tree."""

    def __init__(self, text: str):
        self._lines: dict[KeyPath, int] = {}
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError:
            root = None
        if root is not None:
            self._walk(root, ())

    def _walk(self, node: yaml.Node, path: KeyPath) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = (key_node.value,)
                self._lines[path + key] = key_node.start_mark.line + 1
                self._walk(value_node, path + key)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                self._lines[path + (index,)] = item.start_mark.line + 1
                self._walk(item, path + (index,))

    def key_named_in(self, section: KeyPath, message: str) -> Optional[KeyPath]:
        """The key of `section` set in the file that `message` names first (a check of two keys
        together, e.g. 'MinP (64) must not exceed MaxP (32)', reported at its first key)."""
        first = None
        for path in self._lines:
            if len(path) == len(section) + 1 and path[:-1] == section \
                    and isinstance(path[-1], str):
                found = re.search(rf"(?<!\w){re.escape(path[-1])}(?!\w)", message)
                if found and (first is None or found.start() < first[0]):
                    first = (found.start(), path)
        return first[1] if first else None

    def exact_line(self, path: KeyPath) -> Optional[int]:
        """Line of `path` itself (None where the file does not set it)."""
        return self._lines.get(tuple(path))

    def line(self, path: KeyPath) -> Optional[int]:
        """Line of the deepest prefix of `path` that appears in the file."""
        for end in range(len(path), 0, -1):
            found = self._lines.get(tuple(path[:end]))
            if found is not None:
                return found
        return None


def _model_at(model: type[BaseModel], path: KeyPath) -> Optional[type[BaseModel]]:
    """The pydantic model class that holds the last key of `path` (for listing valid keys)."""
    current: Any = model
    for part in path[:-1]:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        current = field.annotation
        # Optional[X] / SerializeAsAny[X]: look through to the model inside
        for arg in getattr(current, "__args__", ()) or ():
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                current = arg
    if isinstance(current, type) and issubclass(current, BaseModel):
        return current
    return None


def yaml_spelling(value: Any, other=str) -> str:
    """`value` as a recipe writes it: true, false, null; anything else through `other`."""
    if isinstance(value, (bool, type(None))):
        return {True: "true", False: "false", None: "null"}[value]
    return other(value)


def _describe(error: dict) -> str:
    """pydantic's message plus the offending value, minus its internal wording."""
    message = error["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    value = error.get("input")
    if error["type"] not in ("missing", "extra_forbidden") and not isinstance(value, (dict, list)):
        shown = yaml_spelling(value, repr)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        if not message.endswith(f"not {shown}"):
            message += f" (got {shown})"
    return message


_UNION_TAG = re.compile(r"^(int|float|str|bool|none|list|dict|tuple|json-or-python|"
                        r"constrained-[a-z]+|"
                        r"(literal|function-[a-z]+|list|dict|tuple|nullable|is-instance)\[.*)$")


def _without_union_tags(loc: tuple) -> tuple:
    """pydantic's location without the union members it tried (`kv_cache_memory.int`,
    `kv_cache_memory.str`): the key the user wrote, list indices kept. No settings model has a
    field named like a tag; an unknown key (extra_forbidden) keeps its location whole."""
    return tuple(part for part in loc
                 if not (isinstance(part, str) and _UNION_TAG.match(part)))


def validation_problems(exc: ValidationError, model: type[BaseModel], prefix: KeyPath = (),
                        lines: Optional[YamlLines] = None) -> list[str]:
    """One message per pydantic error: 'line N, key.path: what is wrong; what is allowed'."""
    problems, unions = [], {}
    for error in exc.errors():
        raw = tuple(part for part in error["loc"] if part != "__root__")
        loc = raw if error["type"] == "extra_forbidden" else _without_union_tags(raw)
        path = prefix + loc
        if lines and isinstance(error.get("input"), dict) and error["type"] == "value_error":
            path = lines.key_named_in(path, error["msg"]) or path   # a check across its keys
        where = dotted(path)
        line = lines.line(path) if lines else None
        at = f"line {line}, {where}" if line else where
        if error["type"] == "extra_forbidden" and loc:
            owner = _model_at(model, loc)
            allowed = sorted(owner.model_fields) if owner else []
            hint = suggest(str(loc[-1]), allowed)
            text = f"{at}: unknown key" + (f"; did you mean '{hint}'?" if hint else ".")
            if allowed:
                text += f" Allowed keys: {', '.join(allowed)}"
            problems.append(text)
        elif loc != raw and at in unions:         # another member of the same union
            problems[unions[at]] += f"; or {_describe(error)}"
        else:
            if loc != raw:
                unions[at] = len(problems)
            problems.append(f"{at}: {_describe(error)}")
    return problems


_LEADING_KEY = re.compile(r"([a-z_]+(?:\.[a-z_0-9]+)+)(?=[: \[])")   # [: an item of a list
_MENTIONED_KEY = re.compile(r"(?<![\w./])([a-z_]+\.[a-z_][a-z_0-9]*)(?![\w/(])")


def located(message: str, recipe_path: Optional[str]) -> str:
    """An engine error that starts with a recipe key (`parallel.pp: pp=6 ...`, raised while the
    engine is built) with the recipe's file and the line that sets it, or the line of the nearest
    section that is set (`parallel:`); one that only names a key further on (`the KV cache holds
    0 tokens ...; raise memory.kv_cache_memory`) with the line of the first such key the recipe
    sets; as it is when the recipe sets none."""
    if recipe_path is None:
        return message
    match = _LEADING_KEY.match(message)
    mentioned = [] if match else [key for key in _MENTIONED_KEY.findall(message)
                                  if _recipe_key(key)]
    if (match is None or not _recipe_key(match.group(1))) and not mentioned:
        return message
    try:
        lines = YamlLines(Path(recipe_path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return message
    if match is not None:
        line = lines.line(tuple(match.group(1).split(".")))
        return f"{recipe_path} line {line}, {message}" if line is not None else message
    for key in mentioned:                          # only where the recipe sets that very key
        line = lines.exact_line(tuple(key.split(".")))
        if line is not None:
            return f"{recipe_path} line {line} ({key}): {message}"
    return message


def _recipe_key(dotted_key: str) -> bool:
    """Whether `section.key...` names a recipe setting (not a file name, say)."""
    from .recipe import Recipe        # (recipe.py imports this module)

    section, key = dotted_key.split(".")[:2]
    field = Recipe.model_fields.get(section)
    owner = getattr(field, "annotation", None)
    return field is not None and (section == "strategy" or not hasattr(owner, "model_fields")
                                  or key in owner.model_fields)
