"""`structured_outputs`: the sampling key that holds a reply to a JSON schema, a regex, a list of
choices or a grammar, with vLLM 0.32's names and meaning (its StructuredOutputsParams, xgrammar
backend).

This module checks what a request asks for without a tokenizer, as vLLM's front end does
(`validate_xgrammar_grammar`): exactly one kind of constraint, and a spec xgrammar can turn into a
grammar, so a broken schema or regex is the request's `invalid_sampling` error (the recipe's, a
recipe error) and never reaches the engine. The engine side (compiling against the tokenizer,
one matcher per request, the logits mask) is engine/structured_output.py.

xgrammar is an optional dependency (the `structured` extra); it is imported only when a request
asks for structured output.
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# the constraint kinds, in vLLM's order; exactly one is set
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# objects and arrays a JSON schema may nest (vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING)
MAX_JSON_NESTING = 64
EXTRA_HINT = "pip install 'batchinfer[structured]' (or pip install 'xgrammar>=0.2,<0.3')"


def xgrammar():
    """The xgrammar module, or a ValueError naming the extra that installs it."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise ValueError("structured outputs need xgrammar, which is not installed: "
                         f"{EXTRA_HINT}") from None
    return xgr


class StructuredOutputsParams(BaseModel):
    """vLLM's StructuredOutputsParams: one of json (a schema, as an object or its JSON text),
    regex, choice, grammar (xgrammar's EBNF, or Lark), json_object (any JSON object) or
    structural_tag (xgrammar's structural tag, as JSON text)."""

    # `json` is BaseModel's (deprecated) method: the field is json_, read and written as json
    model_config = ConfigDict(extra="forbid", frozen=True, serialize_by_alias=True,
                              validate_by_name=True, validate_by_alias=True)

    json_: Union[dict, str, None] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[str] = None
    # json and json_object: no whitespace between tokens but what the schema's separators need
    disable_any_whitespace: bool = False
    # what xgrammar does anyway (its strict mode: a schema's unlisted properties are refused);
    # accepted for vLLM recipes that set it
    disable_additional_properties: bool = False
    # only vLLM's outlines backend reads it; xgrammar's whitespace is disable_any_whitespace
    whitespace_pattern: Optional[str] = None

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, _field(k)) is not None)

    @field_validator("json_", mode="before")
    @classmethod
    def _schema_or_its_text(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, (dict, str)):
            raise ValueError("json is a JSON schema: an object, or its JSON text as a string")
        return v

    @field_validator("whitespace_pattern")
    @classmethod
    def _no_whitespace_pattern(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            raise ValueError("whitespace_pattern is read only by vLLM's outlines backend; "
                             "batchinfer's is xgrammar (vLLM's default), whose whitespace "
                             "setting is disable_any_whitespace: true")
        return v

    @model_validator(mode="after")
    def _one_spec_xgrammar_reads(self) -> "StructuredOutputsParams":
        given = [k for k in KINDS if getattr(self, _field(k)) is not None]
        if len(given) != 1:
            which = f"{len(given)} are given ({', '.join(given)})" if given else "none is given"
            raise ValueError(f"give exactly one of {', '.join(KINDS)}; {which}")
        kind = given[0]
        spec = getattr(self, _field(kind))
        if isinstance(spec, (dict, list)):         # hashable for spec_problem's cache
            spec = json.dumps(spec) if isinstance(spec, dict) else tuple(spec)
        problem = spec_problem(kind, spec)
        if problem:
            raise ValueError(f"{kind}: {problem}")
        return self

    def spec_key(self) -> tuple:
        """What the grammar compiled for these parameters depends on (engine's cache key)."""
        kind = self.kind
        spec = getattr(self, _field(kind))
        if kind == "json_object":
            spec = None
        elif kind == "choice":
            kind, spec = "grammar", choice_as_grammar(spec)
        elif isinstance(spec, dict):
            spec = json.dumps(spec)
        return kind, spec, self.disable_any_whitespace


def _field(kind: str) -> str:
    return "json_" if kind == "json" else kind


@functools.lru_cache(maxsize=1024)
def spec_problem(kind: str, spec: Any) -> Optional[str]:
    """What keeps xgrammar from turning one spec into a grammar (None: nothing); a dict schema
    comes as its JSON text, choices as a tuple. Cached: a recipe's schema is checked once, not once per line."""
    if kind == "json_object":
        return None if spec is True else ("must be true if set; leave structured_outputs out "
                                          "for unconstrained output")
    if kind == "choice":
        if not spec:
            return "must not be empty (no reply could be produced)"
        return _xgrammar_problem(lambda xgr: xgr.Grammar.from_ebnf(choice_as_grammar(spec)))
    if not isinstance(spec, str) or (kind != "regex" and not spec.strip()):
        return "must not be empty"
    if kind == "regex":
        if "\x00" in spec:
            return "must not contain a NUL character ('\\x00')"
        return _xgrammar_problem(lambda xgr: xgr.Grammar.from_regex(spec))
    if kind == "grammar":
        if grammar_is_likely_lark(spec):
            return _xgrammar_problem(lambda xgr: xgr.Grammar.from_lark(spec))
        return _xgrammar_problem(lambda xgr: xgr.Grammar.from_ebnf(spec))
    if kind == "structural_tag":
        return _xgrammar_problem(lambda xgr: structural_tag_grammar(xgr, spec))
    try:                                                  # json: a schema
        schema = json.loads(spec)
    except ValueError as exc:
        return f"not valid JSON ({exc})"
    except RecursionError:
        return f"nested too deeply: objects and arrays may nest at most {MAX_JSON_NESTING} levels"
    if not isinstance(schema, (dict, bool)):
        return f"a JSON schema is an object (or true / false), not {type(schema).__name__}"
    if _nests_deeper(schema, MAX_JSON_NESTING):
        return f"nested too deeply: objects and arrays may nest at most {MAX_JSON_NESTING} levels"
    unsupported = unsupported_schema_feature(schema)
    if unsupported:
        return (f"the schema uses {unsupported}, which xgrammar (vLLM's default backend, and "
                "batchinfer's) does not enforce; a reply would not be held to it")
    return _xgrammar_problem(lambda xgr: xgr.Grammar.from_json_schema(spec))


_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _xgrammar_problem(build) -> Optional[str]:
    xgr = xgrammar()
    try:
        build(xgr)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError alike
        text = _XGRAMMAR_LOCATION.sub("", str(exc).strip()).strip()
        return f"xgrammar cannot turn it into a grammar: {text.splitlines()[0] if text else exc}"
    return None


def structural_tag_grammar(xgr, spec: str):
    """A structural tag's grammar, in its current form or the legacy {structures, triggers} one
    (vLLM's xgrammar backend reads both)."""
    tag = json.loads(spec)
    if isinstance(tag, dict) and "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                       end=s["end"]) for s in tag["structures"]]
        return xgr.Grammar.from_structural_tag(items, tag["triggers"])
    return xgr.Grammar.from_structural_tag(spec)


def _nests_deeper(spec: Any, limit: int) -> bool:
    level = [spec]
    for _ in range(limit):
        level = [child for node in level if isinstance(node, (dict, list))
                 for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
        if not level:
            return False
    return True


# string formats xgrammar enforces (vLLM's STRING_SUPPORTED_FORMATS)
STRING_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname",
                  "uuid", "uri", "uri-reference", "uri-template", "json-pointer",
                  "relative-json-pointer"}


def unsupported_schema_feature(schema: Any) -> Optional[str]:
    """The first schema keyword xgrammar would ignore, as vLLM's
    has_xgrammar_unsupported_json_features finds them (vLLM then falls back to its guidance
    backend, which batchinfer does not have); None when it enforces the whole schema."""
    if isinstance(schema, list):
        return next(filter(None, map(unsupported_schema_feature, schema)), None)
    if not isinstance(schema, dict):
        return None
    kinds = schema.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
    pattern_and_length = lambda s: (("pattern" in s or "format" in s)  # noqa: E731
                                    and ("minLength" in s or "maxLength" in s))
    found = None
    if kinds & {"integer", "number"} and "multipleOf" in schema:
        found = "multipleOf"
    elif "array" in kinds and {"uniqueItems", "contains", "minContains",
                               "maxContains"} & schema.keys():
        found = sorted({"uniqueItems", "contains", "minContains", "maxContains"}
                       & schema.keys())[0]
    elif "string" in kinds and "format" in schema and schema["format"] not in STRING_FORMATS:
        found = f"format {schema['format']!r}"
    elif "string" in kinds and pattern_and_length(schema):
        found = "pattern or format with minLength / maxLength"
    elif "object" in kinds and "propertyNames" in schema and (
            (isinstance(schema["propertyNames"], dict)
             and pattern_and_length(schema["propertyNames"]))
            or {"patternProperties", "properties"} & schema.keys()
            or schema.get("unevaluatedProperties", True) is not True):
        found = "propertyNames with properties, patternProperties or length bounds"
    elif "object" in kinds and isinstance(schema.get("patternProperties"), dict) and (
            "properties" in schema or len(schema["patternProperties"]) > 1):
        found = "patternProperties with properties, or more than one pattern"
    elif isinstance(schema.get("allOf"), list) and len(schema["allOf"]) >= 2:
        found = "allOf with several branches"
    if found:
        return found
    return next(filter(None, (unsupported_schema_feature(v) for v in schema.values())), None)


def grammar_is_likely_lark(grammar: str) -> bool:
    """vLLM's rule: a grammar with no `::=` rule is Lark, else xgrammar's EBNF."""
    for line in grammar.split("\n"):
        line = re.sub(r"(#|//).*$", "", line).strip()
        if line and "::=" in line:
            return False
    return True


def choice_as_grammar(choice: list[str]) -> str:
    """The choices as an EBNF grammar whose root is one of them, literally (vLLM's)."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escape(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch

    return "root ::= " + " | ".join('"' + "".join(map(escape, c)) + '"' for c in choice)
