"""structured_outputs' parameters, checked without a tokenizer as vLLM's front end checks them:
one kind of constraint, a spec xgrammar turns into a grammar, schema keywords xgrammar would not
enforce named; vLLM's key names (`json`) through a dump and a per-line override; without
xgrammar, an error naming the extra that installs it."""
from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("xgrammar")

from batchinfer.engine.request import SamplingParams  # noqa: E402
from batchinfer.engine.structured_params import (StructuredOutputsParams,  # noqa: E402
                                                 choice_as_grammar, grammar_is_likely_lark,
                                                 unsupported_schema_feature)


def problem(**structured) -> str:
    with pytest.raises(ValueError) as info:
        SamplingParams(structured_outputs=structured)
    return str(info.value)


def test_vllms_names_survive_a_dump_and_an_override():
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    params = SamplingParams(max_tokens=5, structured_outputs={"json": schema})
    dumped = params.model_dump()["structured_outputs"]
    assert dumped["json"] == schema and "json_" not in dumped
    assert list(dumped["json"]["properties"]) == ["b", "a"]     # the schema's order is kept
    again = params.with_overrides(temperature=0)
    assert again.structured_outputs == params.structured_outputs
    assert json.loads(params.model_dump_json())["structured_outputs"]["json"] == schema
    assert params.structured_outputs.spec_key() == ("json", json.dumps(schema), False)
    choice = SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs
    assert choice.kind == "choice" and choice.spec_key()[:2] == ("grammar", 'root ::= "a" | "b"')


def test_exactly_one_kind():
    assert "give exactly one of json, regex, choice, grammar, json_object, structural_tag; " \
        "none is given" in problem()
    assert "2 are given (regex, choice)" in problem(regex="a", choice=["a"])
    assert "2 are given (json, json_object)" in problem(json={"type": "object"}, json_object=True)


@pytest.mark.parametrize("structured,message", [
    ({"json": '{"type": '}, "json: not valid JSON"),
    ({"json": "[1, 2]"}, "json: a JSON schema is an object (or true / false), not list"),
    ({"json": 5}, "json is a JSON schema: an object, or its JSON text as a string"),
    ({"json": {"type": "objectx"}},
     'json: xgrammar cannot turn it into a grammar: Unsupported type "objectx"'),
    ({"regex": "a(b"}, "regex: xgrammar cannot turn it into a grammar: Regex parsing error"),
    ({"regex": "a\x00"}, "regex: must not contain a NUL character"),
    ({"grammar": " "}, "grammar: must not be empty"),
    ({"grammar": "root ::= other"}, 'Rule "other" is not defined'),
    ({"choice": []}, "choice: must not be empty"),
    ({"json_object": False}, "json_object: must be true if set"),
    ({"structural_tag": "{}"}, "structural_tag: xgrammar cannot turn it into a grammar"),
    ({"regex": "a", "whitespace_pattern": r"\s*"},
     "whitespace_pattern is read only by vLLM's outlines backend"),
])
def test_a_spec_xgrammar_cannot_read_is_named(structured, message):
    assert message in problem(**structured)


@pytest.mark.parametrize("schema,feature", [
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "format": "color"}, "format 'color'"),
    ({"type": "string", "pattern": "a+", "maxLength": 3},
     "pattern or format with minLength / maxLength"),
    ({"allOf": [{"type": "string"}, {"enum": ["a"]}]}, "allOf with several branches"),
    ({"type": "object", "properties": {"deep": {"type": "array", "items": {
        "type": "number", "multipleOf": 0.5}}}}, "multipleOf"),
])
def test_schema_keywords_xgrammar_would_not_enforce_are_refused_by_name(schema, feature):
    """vLLM falls back to its guidance backend for these; batchinfer, with xgrammar only,
    refuses them rather than run a reply the schema's keyword does not hold."""
    assert unsupported_schema_feature(schema) == feature
    assert f"the schema uses {feature}, which xgrammar" in problem(json=schema)
    assert unsupported_schema_feature({"type": "string", "format": "email"}) is None
    assert unsupported_schema_feature({"type": "string", "maxLength": 5}) is None


def test_a_schema_nested_too_deep_is_refused():
    deep: dict = {"type": "string"}
    for _ in range(70):
        deep = {"type": "array", "items": deep}
    assert "nested too deeply" in problem(json=deep)


def test_choices_are_literal_and_the_grammar_dialect_is_vllms_guess():
    grammar = choice_as_grammar(['say "hi"', "back\\slash", "two\nlines"])
    assert grammar == r'root ::= "say \"hi\"" | "back\\slash" | "two\nlines"'
    SamplingParams(structured_outputs={"choice": ['say "hi"', "two\nlines"]})
    assert grammar_is_likely_lark('start: "a" | "b"')
    assert not grammar_is_likely_lark('# comment\nroot ::= "a"')
    lark = StructuredOutputsParams(grammar='start: "yes" | "no"')
    assert lark.kind == "grammar"


def test_without_xgrammar_the_error_names_the_extra(monkeypatch):
    from batchinfer.engine import structured_output

    monkeypatch.setitem(sys.modules, "xgrammar", None)         # import xgrammar: ImportError
    assert "pip install 'batchinfer[structured]'" in problem(regex="[0-9]{1,7}x")
    with pytest.raises(ValueError, match=r"batchinfer\[structured\]"):
        structured_output.xgrammar()
