"""Input checks a QA pass found missing: metadata columns the file lacks, lone surrogates, CSV's
empty cells and line numbers, empty parquet files, OpenAI nulls, stop token ids."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from batchinfer.engine.errors import ConfigError, RequestError
from batchinfer.engine.request import SamplingParams
from batchinfer.runner.io.input_records import InputError, RequestSpec, parse_openai
from batchinfer.runner.io.inputs import InputFileError, InputReader
from batchinfer.runner.recipe import IOConfig

DEFAULTS = SamplingParams(max_tokens=4)


def _read(path: Path, defaults: SamplingParams = DEFAULTS, **io) -> list:
    return list(InputReader(path, IOConfig(**io), defaults))


def _dataset(path: Path, columns: dict) -> Path:
    import datasets

    ds = datasets.Dataset.from_dict(columns)
    if path.suffix == ".parquet":
        ds.to_parquet(str(path))
    elif path.suffix == ".csv":
        ds.to_csv(str(path), index=False)
    else:
        import pyarrow as pa

        with pa.OSFile(str(path), "wb") as sink:
            with pa.ipc.new_stream(sink, ds.data.table.schema) as writer:
                writer.write_table(ds.data.table)
    return path


# --- io.metadata_fields -----------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", ["parquet", "csv", "arrow"])
def test_a_metadata_column_the_file_lacks_is_refused_before_a_model_loads(tmp_path, suffix):
    """It used to put "nothere": null into every output's metadata without a word."""
    path = _dataset(tmp_path / f"in.{suffix}", {"id": ["x1", "x2"], "prompt": ["Hi", "Yo"],
                                                 "team": ["a", "b"]})
    with pytest.raises(InputFileError, match=r"in\.\w+: io.metadata_fields names a column the "
                                             r"file does not have: 'nothere' \(columns: id, "
                                             r"prompt, team\)"):
        InputReader(path, IOConfig(metadata_fields=["team", "nothere"]), DEFAULTS)
    with pytest.raises(InputFileError, match=r"'tem' \(did you mean 'team'\?\)"):
        InputReader(path, IOConfig(metadata_fields=["tem"]), DEFAULTS)
    first, _ = _read(path, metadata_fields=["team"])
    assert first.metadata == {"team": "a"}


def test_json_rows_missing_a_metadata_column_warn_once_and_run(tmp_path, caplog):
    """JSON rows have no schema (a column may be sparse): a warning naming the column, null kept."""
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"prompt": "Hi", "team": "a"}, {"prompt": "Yo", "team": "b"}]))
    with caplog.at_level(logging.WARNING, logger="batchinfer"):
        items = _read(path, metadata_fields=["team", "nothere"])
        _read(path, metadata_fields=["team", "nothere"])           # read again: no second one
    assert [i.metadata for i in items] == [{"team": "a", "nothere": None},
                                           {"team": "b", "nothere": None}]
    warnings = [r.getMessage() for r in caplog.records if "nothere" in r.getMessage()]
    assert len(warnings) == 1
    assert "io.metadata_fields 'nothere' is in none of the 2 rows read" in warnings[0]
    caplog.clear()
    sparse = tmp_path / "sparse.json"
    sparse.write_text(json.dumps([{"prompt": "Hi"}, {"prompt": "Yo", "team": "b"}]))
    with caplog.at_level(logging.WARNING, logger="batchinfer"):
        _read(sparse, metadata_fields=["team"])
    assert "io.metadata_fields" not in caplog.text                 # present in some row: fine


def test_jsonl_input_says_metadata_fields_do_not_apply(tmp_path, caplog):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "Hi", "metadata": {"team": "a"}}\n')
    with caplog.at_level(logging.WARNING, logger="batchinfer"):
        (spec,) = _read(path, metadata_fields=["team"])
    assert spec.metadata == {"team": "a"}
    assert "io.metadata_fields (team) applies to dataset files" in caplog.text


# --- lone surrogates --------------------------------------------------------------------------------
def test_a_lone_surrogate_is_invalid_text_with_its_place(tmp_path):
    """It used to reach the tokenizer: [tokenization_failed] TypeError: TextEncodeInput must be..."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "prompt": "ab\\ud800c"}\n'
                    '{"id": "b", "messages": [{"role": "user", "content": "\\udfffx"}]}\n'
                    '{"id": "c", "prompt": "pair \\ud83d\\ude00 is fine"}\n')
    first, second, third = _read(path)
    assert first.code == "invalid_text" and first.line == 1
    assert first.message == ("'prompt' holds a lone UTF-16 surrogate (U+D800) at character 2; "
                             "text must be valid Unicode")
    assert second.code == "invalid_text" and "messages[0].content" in second.message
    assert isinstance(third, RequestSpec) and "\U0001F600" in third.prompt
    body = {"custom_id": "r", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "x\ud800"}}
    err = parse_openai(body, 1, DEFAULTS)
    assert err.code == "invalid_text" and err.message.startswith("body.prompt holds")


# --- CSV --------------------------------------------------------------------------------------------
def test_an_empty_csv_prompt_cell_is_an_empty_prompt(tmp_path):
    """Not `invalid_type ... not null`: a CSV cell cannot be null, only empty (parquet's "" is
    empty_prompt too)."""
    path = tmp_path / "in.csv"
    path.write_text("id,prompt,team\nx1,What is 2+2?,a\nx2,Say hi,b\nx3,,c\n")
    items = _read(path)
    assert items[2].code == "empty_prompt"
    assert items[2].message == "column 'prompt' (io.prompt_field) is empty"


def test_a_csv_records_line_is_its_row_number(tmp_path):
    """Documented (docs/recipe.md): for dataset files `line` is the row number, header not
    counted (resume skips errors by it, default ids row-N count the same way)."""
    path = tmp_path / "in.csv"
    path.write_text("id,prompt\nx1,Hi\nx2,\nx3,\"two\nlines\"\n,Yo\n")
    items = _read(path)
    assert [i.line for i in items] == [1, 2, 3, 4]
    assert items[1].code == "empty_prompt" and items[3].request_id == "row-4"


# --- empty files ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["empty.parquet", "header.csv", "empty.arrow"])
def test_a_dataset_file_without_rows_holds_no_requests(tmp_path, name):
    """An empty parquet file used to fail: cannot read it as parquet (BatchSize must be greater
    than 0, got 0); now it is what an empty CSV or JSONL file is, no records (the job warns)."""
    path = tmp_path / name
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())})
    if name == "header.csv":
        path.write_text("id,prompt\n")
    elif name == "empty.parquet":        # pyarrow (and pandas) write one row group of 0 rows
        pq.write_table(table, str(path))
    else:
        with pa.OSFile(str(path), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
    reader = InputReader(path, IOConfig(), DEFAULTS)
    assert list(reader) == []
    assert reader.total() in (0, None)


# --- OpenAI nulls -----------------------------------------------------------------------------------
def test_openai_null_sampling_fields_mean_the_default():
    """OpenAI reads null as "use the default"; it used to be invalid_sampling."""
    defaults = SamplingParams(max_tokens=4, temperature=0.5, stop=["\n\n"])
    body = {"messages": [{"role": "user", "content": "Hi"}], "temperature": None, "top_p": None,
            "stop": None, "seed": None, "n": None, "max_tokens": None, "logprobs": None,
            "top_logprobs": None, "presence_penalty": None, "top_k": None}
    spec = parse_openai({"custom_id": "r", "method": "POST", "url": "/v1/chat/completions",
                         "body": body}, 1, defaults)
    assert isinstance(spec, RequestSpec), spec
    assert spec.sampling == defaults
    bad = parse_openai({"custom_id": "r", "method": "POST", "url": "/v1/chat/completions",
                        "body": {**body, "temperature": -1}}, 1, defaults)
    assert isinstance(bad, InputError) and bad.code == "invalid_sampling"


# --- stop token ids against the vocabulary ----------------------------------------------------------
def test_stop_token_ids_past_the_vocabulary(tmp_path):
    """A request's own: its error record (invalid_sampling); the recipe's: a ConfigError that
    names sampling.stop_token_ids (validate exits 2), not one error per line. The vocabulary is
    the model's, as for prompt ids."""
    from batchinfer.runner.io.admission import check_recipe_stop_ids, check_stop_token_ids

    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "prompt": "Hi", "stop_token_ids": [5, 999999999]}\n'
                    '{"id": "b", "prompt": "Hi", "stop_token_ids": [99]}\n'
                    '{"id": "c", "prompt": "Hi", "stop_token_ids": [-1]}\n')
    first, second, third = _read(path)
    with pytest.raises(RequestError) as exc:
        check_stop_token_ids(first, 100)
    assert exc.value.code == "invalid_sampling"
    assert exc.value.message == ("stop_token_ids: [999999999] out of range; this model's token "
                                 "ids are 0..99")
    check_stop_token_ids(second, 100)
    with pytest.raises(RequestError):
        check_stop_token_ids(second, 99)                 # the model's size, not a tokenizer's
    assert third.code == "invalid_sampling" and third.message.startswith("stop_token_ids[0]: ")
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "Hi"}\n')
    (inherited,) = _read(plain, SamplingParams(stop_token_ids=[100]))
    check_stop_token_ids(inherited, 100)                 # the recipe's: checked once, at start
    with pytest.raises(ConfigError, match=r"^sampling.stop_token_ids: \[100\] out of range"):
        check_recipe_stop_ids(inherited.sampling, 100)
    batch = tmp_path / "batch.jsonl"        # an OpenAI batch line's are under body.
    batch.write_text('{"custom_id": "o", "method": "POST", "url": "/v1/completions", '
                     '"body": {"prompt": "Hi", "stop_token_ids": [100]}}\n')
    (line,) = _read(batch)
    with pytest.raises(RequestError, match=r"^body\.stop_token_ids: \[100\] out of range"):
        check_stop_token_ids(line, 100)


def test_always_on_a_tokenizer_without_a_chat_template_names_the_recipe_key(tmp_path,
                                                                            default_model_dir):
    """A plain prompt under io.chat_template: always, on a model without a template: its error
    names the recipe's setting and the way out, not 'send prompt instead of messages'."""
    import shutil

    import transformers

    from batchinfer.engine.tokenizer import Tokenizer
    from batchinfer.runner.io.admission import prompt_token_ids

    for f in default_model_dir.glob("tokenizer*"):       # no chat_template.jinja: no template
        shutil.copy(f, tmp_path / f.name)
    tokenizer = Tokenizer(transformers.AutoTokenizer.from_pretrained(str(tmp_path)), "m")
    assert not tokenizer.has_chat_template
    plain, chat = RequestSpec(1, "p", prompt="Hi"), RequestSpec(2, "c", messages=[
        {"role": "user", "content": "Hi"}])
    assert prompt_token_ids(plain, tokenizer, "auto") == tokenizer.encode("Hi")
    with pytest.raises(RequestError) as exc:
        prompt_token_ids(plain, tokenizer, "always")
    assert exc.value.code == "no_chat_template"
    assert exc.value.message == ("io.chat_template: always wraps each prompt in the chat "
                                 "template, and the tokenizer of m has no chat template: set "
                                 "io.chat_template: auto to send prompts as written")
    with pytest.raises(RequestError, match=r"has no chat template; send 'prompt' instead of "
                                           r"'messages', or give one as model.chat_template$"):
        prompt_token_ids(chat, tokenizer, "always")
    # an OpenAI chat completions line has no 'prompt': the advice is its own form's
    openai_chat = RequestSpec(3, "o", messages=chat.messages, openai_url="/v1/chat/completions")
    with pytest.raises(RequestError) as exc:
        prompt_token_ids(openai_chat, tokenizer, "auto")
    assert exc.value.message == ("the tokenizer of m has no chat template; send the line to "
                                 "/v1/completions with body.prompt instead, or give one as "
                                 "model.chat_template")


@pytest.mark.parametrize("url", [["/v1/completions"], {"a": 1}, None, 7])
def test_an_openai_url_of_another_type_is_that_lines_error_in_both_job_kinds(url):
    """The envelope check (input_records.openai_line) is shared by generation and embedding
    lines; a url that is not a string (an array could not be looked up in the url table) is
    the line's unsupported_url error, never an exception."""
    from batchinfer.runner.io.embed_inputs import parse_embed_openai

    line = {"custom_id": "c1", "method": "POST", "url": url, "body": {}}
    for parsed in (parse_openai(line, 4, DEFAULTS), parse_embed_openai(line, 4)):
        assert isinstance(parsed, InputError)
        assert (parsed.code, parsed.line, parsed.custom_id, parsed.openai_url) == \
            ("unsupported_url", 4, "c1", None)
