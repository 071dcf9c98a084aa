"""structured_outputs as input lines and recipes write it: the key itself (plain, chat and OpenAI
lines), OpenAI's response_format mapped as vLLM's server maps it, vLLM's removed guided_* keys
named with what replaced them; a broken schema, regex or grammar is the line's invalid_sampling
error (the job goes on) and the recipe's own a recipe error."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")

from batchinfer.engine.request import SamplingParams  # noqa: E402
from batchinfer.runner.io.input_records import (InputError, parse_openai,  # noqa: E402
                                                parse_plain_or_chat)
from batchinfer.runner.job import EXIT_OK, JobSpec, run_job  # noqa: E402
from batchinfer.runner.recipe import RecipeError, load_recipe  # noqa: E402

DEFAULTS = SamplingParams(max_tokens=8)
TINY_MODEL = {"load_format": "dummy", "max_model_len": 512, "hf_overrides": {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def openai(url="/v1/chat/completions", **body):
    body.setdefault("messages" if url.endswith("chat/completions") else "prompt",
                    [{"role": "user", "content": "hi"}] if url.endswith("chat/completions")
                    else "Once upon a time")
    return parse_openai({"custom_id": "c1", "method": "POST", "url": url, "body": body}, 1,
                        DEFAULTS)


def asked(parsed) -> dict:
    assert not isinstance(parsed, InputError), parsed.message
    return parsed.sampling.structured_outputs.model_dump(exclude_defaults=True)


def test_response_format_maps_as_vllms_server():
    schema_format = {"type": "json_schema",
                     "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    assert asked(openai(response_format=schema_format)) == {"json": SCHEMA}
    assert asked(openai(response_format={"type": "json_object"})) == {"json_object": True}
    assert asked(openai("/v1/completions", response_format={"type": "json_object"})) == {
        "json_object": True}
    assert openai(response_format={"type": "text"}).sampling.structured_outputs is None
    assert asked(openai(structured_outputs={"choice": ["a", "b"]})) == {"choice": ["a", "b"]}
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "Hi"}}
    assert json.loads(asked(openai(response_format=tag))["structural_tag"]) == tag


@pytest.mark.parametrize("body,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "body.response_format: type json_schema needs json_schema: {name, schema}"),
    ({"response_format": {"type": "xml"}},
     "body.response_format.type must be one of text, json_object, json_schema, structural_tag "
     '(got "xml")'),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     'body.response_format: json: xgrammar cannot turn it into a grammar: Unsupported type '
     '"objectx"'),
    ({"structured_outputs": {"regex": "a("}},
     "body.structured_outputs: regex: xgrammar cannot turn it into a grammar: Regex parsing "
     "error at position 3"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "body.structured_outputs + response_format: give exactly one of json, regex, choice, "
     "grammar, json_object, structural_tag; 2 are given (regex, json_object)"),
    ({"guided_json": SCHEMA},
     "body.guided_json is a guided-decoding key vLLM has removed (it ignores it, so the output "
     "would not be constrained); write body.structured_outputs: {json: ...}"),
])
def test_a_bad_structured_line_is_named(body, message):
    err = openai(**body)
    assert isinstance(err, InputError) and err.message.startswith(message), err.message
    assert err.code in ("invalid_sampling", "unsupported_parameter")


@pytest.mark.parametrize("structured,message", [
    ({"json": '{"type": '}, "structured_outputs: json: not valid JSON"),
    ({"json": {"type": "integer", "multipleOf": 3}},
     "structured_outputs: json: the schema uses multipleOf, which xgrammar"),
    ({"choice": []}, "structured_outputs: choice: must not be empty"),
    ({"grammar": "root ::= missing"}, 'structured_outputs: grammar: xgrammar cannot turn it '
     'into a grammar: EBNF parser error at line 1, column 10: Rule "missing" is not defined'),
    ({}, "structured_outputs: give exactly one of json, regex"),
    ({"json_object": False}, "structured_outputs: json_object: must be true if set"),
    ({"regex": "a", "whitespace_pattern": " "},
     "structured_outputs.whitespace_pattern: whitespace_pattern is read only by vLLM's "
     "outlines backend"),
])
def test_a_plain_lines_structured_outputs_is_checked(structured, message):
    err = parse_plain_or_chat({"id": "x", "prompt": "hi", "structured_outputs": structured}, 4,
                              DEFAULTS)
    assert isinstance(err, InputError) and err.code == "invalid_sampling"
    assert err.message.startswith(message), err.message
    assert err.request_id == "x"


def test_a_plain_line_with_a_removed_guided_key_is_told_the_new_one():
    err = parse_plain_or_chat({"prompt": "hi", "guided_regex": "[0-9]+"}, 1, DEFAULTS)
    assert err.code == "unsupported_parameter"
    assert "write structured_outputs: {regex: ...}" in err.message


def test_the_recipes_structured_outputs_are_checked_at_load(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("model:\n  path: x\nsampling:\n  structured_outputs:\n"
                    "    regex: '[0-9]{3'\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert "sampling.structured_outputs" in str(info.value)
    assert "xgrammar cannot turn it into a grammar" in str(info.value)
    path.write_text("model:\n  path: x\nsampling:\n  structured_outputs:\n"
                    '    choice: ["yes", "no"]\n')
    so = load_recipe(path).sampling.structured_outputs
    assert so.choice == ["yes", "no"]


def test_a_job_writes_constrained_replies_and_a_bad_schema_is_its_lines_error(tmp_path):
    """A recipe's default constraint holds for every line that sets none; a line's own replaces
    it; a line whose schema does not compile is an error record and the job goes on."""
    from batchinfer.engine.engine import Engine
    from batchinfer.runner.recipe import Recipe

    recipe = Recipe(model=TINY_MODEL, memory={"kv_cache_memory": "16MiB"},
                    sampling=SamplingParams(max_tokens=12, temperature=0,
                                            structured_outputs={"choice": ["red", "green"]}),
                    strategy={"name": "baseline", "max_num_seqs": 8},
                    report={"refresh_seconds": 0.2, "plots": False})
    engine = Engine.from_config(recipe.engine_config())
    lines = [{"id": "default", "prompt": "Pick a colour"},
             {"id": "own", "prompt": "A number", "structured_outputs": {"regex": "[0-9]{2}"}},
             {"id": "broken", "prompt": "x", "structured_outputs": {"json": {"type": "nope"}}},
             {"custom_id": "oa", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}],
                       "response_format": {"type": "json_schema", "json_schema": {
                           "name": "two", "schema": {"enum": ["one", "two"]}}}}}]
    plain = write_jsonl(tmp_path / "in.jsonl", lines[:3])
    outcome = run(recipe, plain, tmp_path / "run", engine)
    assert outcome.exit_code == EXIT_OK and outcome.outputs == 2
    texts = {o["id"]: o["text"] for o in read_jsonl(tmp_path / "run" / "outputs.jsonl")}
    assert texts["default"] in ("red", "green")
    assert len(texts["own"]) == 2 and texts["own"].isdigit()
    (error,) = read_jsonl(tmp_path / "run" / "errors.jsonl")
    assert error["id"] == "broken" and error["code"] == "invalid_sampling"
    assert 'Unsupported type "nope"' in error["message"] and error["line"] == 3
    batch = write_jsonl(tmp_path / "oa.jsonl", lines[3:])
    run(recipe, batch, tmp_path / "run_oa", engine)
    (record,) = read_jsonl(tmp_path / "run_oa" / "outputs.jsonl")
    reply = record["response"]["body"]["choices"][0]["message"]["content"]
    assert json.loads(reply) in ("one", "two")


def run(recipe, input_path, out_dir, engine):
    return run_job(JobSpec(recipe=recipe, input_path=input_path, output_dir=out_dir,
                           progress="off", engine_factory=lambda cfg: engine))


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def write_jsonl(path, lines: list):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
