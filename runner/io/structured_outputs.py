"""How an input line asks for structured output besides the `structured_outputs` sampling key:
an OpenAI body's `response_format` (mapped as vLLM's server maps it), and the guided_* keys vLLM
has removed (its server now ignores them with a warning, leaving the output unconstrained;
batchinfer names the key that replaces them instead).
"""
from __future__ import annotations

import json
from typing import Any, Optional

# vLLM's removed guided-decoding keys -> the structured_outputs key that replaced each
REMOVED_GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                       "guided_grammar": "grammar", "guided_whitespace_pattern": None,
                       "guided_decoding_backend": None}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


def removed_guided_key(record: dict, where: str) -> Optional[str]:
    """The problem with the first of vLLM's removed guided_* keys a line sets (None: none)."""
    for key in sorted(REMOVED_GUIDED_KEYS.keys() & record.keys()):
        replacement = REMOVED_GUIDED_KEYS[key]
        instead = (f"write {where}structured_outputs: {{{replacement}: ...}}" if replacement
                   else "leave it out (batchinfer's structured outputs are xgrammar's)")
        return (f"{where}{key} is a guided-decoding key vLLM has removed (it ignores it, so the "
                f"output would not be constrained); {instead}")
    return None


def from_response_format(value: Any) -> tuple[Optional[dict], Optional[str]]:
    """An OpenAI body's response_format -> (structured_outputs keys or None, a problem or None),
    as vLLM's server maps it: json_schema's schema to json, json_object to json_object: true,
    a structural_tag format as its JSON text; text asks for nothing."""
    where = "body.response_format"
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMAT_TYPES:
        got = value.get("type") if isinstance(value, dict) else value
        return None, (f"{where}.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)} (got "
                      f"{json.dumps(got, default=repr)})")
    kind = value["type"]
    if kind == "text":
        return None, None
    if kind == "json_object":
        return {"json_object": True}, None
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(value)}, None
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or spec.get("schema") is None:
        return None, (f"{where}: type json_schema needs json_schema: {{name, schema}}, the "
                      "schema the reply must follow")
    return {"json": spec["schema"]}, None


def merge_response_format(overrides: dict, body: dict, written: dict) -> Optional[str]:
    """body.response_format's constraint into the sampling overrides (over any structured_outputs
    the body sets, as vLLM's server replaces those fields); None or the problem."""
    if body.get("response_format") is None:
        return None
    mapped, problem = from_response_format(body["response_format"])
    if problem or mapped is None:
        return problem
    given = overrides.get("structured_outputs")
    overrides["structured_outputs"] = {**(given if isinstance(given, dict) else {}), **mapped}
    written["structured_outputs"] = ("structured_outputs + response_format" if given is not None
                                     else "response_format")
    if "json" in mapped:
        written["structured_outputs.json"] = "response_format.json_schema.schema"
    return None
