"""Input reading: every bad line its own error with its line number, streaming, formats, shards."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchinfer.runner.id_set import IdSet
from batchinfer.runner.io.input_records import (InputError, RequestSpec, parse_openai,
                                             parse_plain_or_chat)
from batchinfer.runner.io.inputs import InputFileError, InputReader, Shard, detect_format
from batchinfer.runner.recipe import IOConfig, Recipe
from batchinfer.engine.request import SamplingParams

DEFAULTS = SamplingParams(max_tokens=8)


def _write_lines(path: Path, lines: list) -> Path:
    raw = [line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines]
    path.write_bytes(b"\n".join(raw) + b"\n")
    return path


def _read(path: Path, **io) -> list:
    return list(InputReader(path, IOConfig(**io), DEFAULTS))


def _by_line(items) -> dict:
    return {item.line: item for item in items}


# --- plain / chat lines -----------------------------------------------------------------------------
BAD_LINES = [
    (b'{"id": "a", "prompt": "x"', "invalid_json"),
    (b"[1, 2]", "not_an_object"),
    (b'"just a string"', "not_an_object"),
    ({"id": "b"}, "missing_prompt"),
    ({"id": "c", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "ambiguous_request"),
    ({"id": "d", "prompt": 42}, "invalid_type"),
    ({"id": "d2", "prompt": [1, "2"]}, "invalid_type"),
    ({"id": "d3", "prompt": [True, 5]}, "invalid_type"),
    ({"id": "d4", "prompt": []}, "empty_prompt"),
    ({"id": ["e"], "prompt": "x"}, "invalid_type"),
    ({"id": "f", "prompt": "x", "metadata": "nope"}, "invalid_type"),
    ({"id": "g", "messages": "hi"}, "invalid_messages"),
    ({"id": "h", "messages": []}, "invalid_messages"),
    ({"id": "i", "messages": [{"role": "user"}]}, "invalid_messages"),
    ({"id": "j", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "invalid_messages"),
    ({"id": "k", "prompt": "x", "temprature": 0.5}, "unknown_key"),
    ({"id": "l", "prompt": "x", "temperature": -0.1}, "invalid_sampling"),
    ({"id": "m", "prompt": "x", "top_p": 1.5}, "invalid_sampling"),
    ({"id": "n", "prompt": "x", "max_tokens": 0}, "invalid_sampling"),
    ({"id": "o", "prompt": "x", "max_tokens": "ten"}, "invalid_sampling"),
    ({"id": "o2", "prompt": "x", "max_tokens": True}, "invalid_sampling"),   # not 1 token
    ({"id": "o3", "prompt": "x", "stop_token_ids": [True]}, "invalid_sampling"),   # not [1]
    ({"id": "p", "prompt": ""}, "empty_prompt"),
    (b'{"id": "q", "prompt": "caf\xc3\x28"}', "invalid_utf8"),
]


@pytest.mark.parametrize("line,code", BAD_LINES, ids=[c for _, c in BAD_LINES])
def test_bad_line_gets_error_with_its_line_number(tmp_path, line, code):
    path = _write_lines(tmp_path / "in.jsonl", [{"id": "ok1", "prompt": "hello"}, line,
                                                {"id": "ok2", "prompt": "bye"}])
    items = _by_line(_read(path))
    assert isinstance(items[1], RequestSpec) and isinstance(items[3], RequestSpec)
    err = items[2]
    assert isinstance(err, InputError), err
    assert err.code == code and err.line == 2 and err.message


def test_error_messages_say_what_is_allowed(tmp_path):
    path = _write_lines(tmp_path / "in.jsonl", [{"prompt": "x", "temprature": 1},
                                                {"prompt": "x", "top_p": 2}])
    first, second = _read(path)
    assert "did you mean 'temperature'" in first.message and "allowed:" in first.message
    assert "top_p" in second.message and "less than or equal to 1" in second.message


def test_overrides_apply_over_recipe_defaults():
    spec = parse_plain_or_chat({"id": 7, "prompt": "x", "temperature": 0, "stop": "\n",
                                "metadata": {"a": 1}}, 3, DEFAULTS)
    assert spec.request_id == "7" and spec.metadata == {"a": 1}
    assert spec.sampling.temperature == 0 and spec.sampling.max_tokens == 8
    assert spec.sampling.stop == ["\n"]


def test_missing_id_is_derived_from_line_number():
    assert parse_plain_or_chat({"prompt": "x"}, 12, DEFAULTS).request_id == "line-12"


def test_plain_prompt_may_be_token_ids(tmp_path):
    items = _read(_write_lines(tmp_path / "in.jsonl", [{"id": "t", "prompt": [5, 6, 7]}]))
    assert items[0].prompt == [5, 6, 7] and items[0].messages is None


def test_duplicate_ids_after_the_first_are_errors(tmp_path):
    path = _write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "1"}, {"id": "b", "prompt": "2"},
                                                {"id": "a", "prompt": "3"}])
    items = _read(path)
    assert [type(i).__name__ for i in items] == ["RequestSpec", "RequestSpec", "InputError"]
    assert items[2].code == "duplicate_id" and items[2].line == 3
    assert items[2].message.startswith("id 'a' appears on an earlier line")


def test_blank_lines_and_bom_are_skipped(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n\n  \r\n{"prompt": "b"}\r\n{"prompt": "c"}')
    items = _read(path)
    assert [i.line for i in items] == [1, 4, 5] and all(isinstance(i, RequestSpec) for i in items)


def test_long_line_is_skipped_without_loading_it(tmp_path):
    path = _write_lines(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "x" * 5_000_000},
                                                {"prompt": "c"}])
    items = _read(path, max_line_bytes="1MiB")
    assert items[1].code == "line_too_long" and items[1].line == 2
    assert "1048576" in items[1].message
    assert isinstance(items[2], RequestSpec) and items[2].line == 3


def test_reader_streams_in_bounded_memory(tmp_path):
    import tracemalloc

    path = tmp_path / "big.jsonl"
    with open(path, "w") as fh:
        for i in range(50_000):
            fh.write(json.dumps({"id": f"r{i}", "prompt": "p" * 200}) + "\n")
    tracemalloc.start()
    count = sum(1 for _ in InputReader(path, IOConfig(), DEFAULTS))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert count == 50_000
    assert peak < 12 * 2**20, peak  # the file is ~11 MB; ids are kept as 12-byte digests


def test_limit_counts_input_records(tmp_path):
    path = _write_lines(tmp_path / "in.jsonl", [{"prompt": str(i)} for i in range(10)])
    reader = InputReader(path, IOConfig(), DEFAULTS, limit=4)
    assert [i.line for i in reader] == [1, 2, 3, 4]
    assert reader.total() == 4


def test_shards_partition_the_input(tmp_path):
    path = _write_lines(tmp_path / "in.jsonl", [{"prompt": str(i)} for i in range(10)])
    seen = []
    for index in range(3):
        reader = InputReader(path, IOConfig(), DEFAULTS, shard=Shard(index, 3))
        lines = [i.line for i in reader]
        assert reader.total() == len(lines)
        seen += lines
    assert sorted(seen) == list(range(1, 11))


def test_resume_skips_done_but_still_flags_later_duplicates(tmp_path):
    path = _write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "1"}, {"id": "b", "prompt": "2"},
                                                {"id": "a", "prompt": "3"}, b"oops",
                                                {"id": "c", "prompt": "4"}])
    reader = InputReader(path, IOConfig(), DEFAULTS)
    items = list(reader.records(done_ids=IdSet(["a"]), done_lines=IdSet(["4"])))
    assert [(i.line, type(i).__name__) for i in items] == [
        (2, "RequestSpec"), (3, "InputError"), (5, "RequestSpec")]
    assert items[1].code == "duplicate_id"
    assert reader.skipped_done == 2


# --- OpenAI batch lines -----------------------------------------------------------------------------
def _openai(url="/v1/chat/completions", method="POST", **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    if url == "/v1/completions":
        body.pop("messages")
        body.setdefault("prompt", "Once upon a time")
    return {"custom_id": "c1", "method": method, "url": url, "body": body}


def test_openai_chat_line_maps_to_sampling():
    spec = parse_openai(_openai(max_completion_tokens=5, temperature=0.1, logprobs=True,
                                top_logprobs=2, model="gpt-x", seed=3), 1, DEFAULTS)
    assert isinstance(spec, RequestSpec), spec
    assert spec.request_id == "c1" and spec.custom_id == "c1"
    assert spec.sampling.max_tokens == 5 and spec.sampling.temperature == 0.1
    assert spec.sampling.logprobs == 2 and spec.sampling.seed == 3
    assert spec.extra["model"] == "gpt-x"


def test_an_openai_body_without_max_tokens_gets_its_endpoints_default():
    """As OpenAI and vLLM's server read a body without max_tokens / max_completion_tokens: a
    chat reply may take the rest of the context (it was cut at the recipe's default of 16
    tokens, silently), a completion gets 16; a recipe that sets max_tokens sets both."""
    unset = SamplingParams()
    assert parse_openai(_openai(), 1, unset).sampling.max_tokens is None
    assert parse_openai(_openai(max_tokens=None), 1, unset).sampling.max_tokens is None
    assert parse_openai(_openai("/v1/completions"), 1, unset).sampling.max_tokens == 16
    assert parse_openai(_openai(), 1, DEFAULTS).sampling.max_tokens == 8       # the recipe's
    assert parse_openai(_openai(max_tokens=3), 1, unset).sampling.max_tokens == 3
    assert parse_openai(_openai(min_tokens=4), 1, unset).sampling.min_tokens == 4


def test_openai_completion_line_accepts_token_ids():
    spec = parse_openai(_openai("/v1/completions", prompt=[1, 2, 3], max_tokens=4), 1, DEFAULTS)
    assert spec.prompt == [1, 2, 3] and spec.sampling.max_tokens == 4


def test_openai_lines_that_state_a_default_run():
    """Scripts and SDKs write the defaults out: tool_choice "none", best_of 1, a text
    response_format, ... ask for nothing batchinfer does not do; another value still does
    (response_format's others are structured outputs: test_structured_inputs.py)."""
    stated = _openai(tool_choice="none", tools=[], response_format={"type": "text"},
                     logit_bias={}, functions=None, modalities=["text"])
    assert not isinstance(parse_openai(stated, 1, DEFAULTS), InputError)
    completion = _openai("/v1/completions", prompt="Hi", best_of=1, echo=False, suffix="")
    assert not isinstance(parse_openai(completion, 1, DEFAULTS), InputError)
    for asked in (_openai(tool_choice="auto"),
                  _openai("/v1/completions", prompt="Hi", best_of=True),
                  _openai("/v1/completions", prompt="Hi", best_of=2)):
        err = parse_openai(asked, 1, DEFAULTS)
        assert isinstance(err, InputError) and err.code == "unsupported_parameter", asked
    assert "(only 1, the default)" in parse_openai(
        _openai("/v1/completions", prompt="Hi", best_of=2), 1, DEFAULTS).message


@pytest.mark.parametrize("line,code", [
    (_openai(url="/v1/embeddings"), "unsupported_url"),
    (_openai(method="GET"), "unsupported_method"),
    ({**_openai(), "custom_id": None}, "invalid_custom_id"),
    (_openai(tools=[{}]), "unsupported_parameter"),
    (_openai(stream=True), "unsupported_parameter"),
    (_openai(temperatur=1), "unknown_key"),
    (_openai(temperature=-2), "invalid_sampling"),
    (_openai(n=0), "invalid_sampling"),
    ({**_openai(), "body": "x"}, "invalid_body"),
    (_openai("/v1/completions", prompt=["a", "b"]), "invalid_type"),
    ({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": {}}, "missing_prompt"),
])
def test_openai_bad_lines(line, code):
    err = parse_openai(line, 9, DEFAULTS)
    assert isinstance(err, InputError), err
    assert err.code == code and err.line == 9
    if code != "invalid_custom_id":
        assert err.custom_id == "c1"


def test_openai_errors_name_the_key_the_line_wrote():
    err = parse_openai(_openai(max_completion_tokens=True), 1, DEFAULTS)
    assert err.code == "invalid_sampling"
    assert err.message == "body.max_completion_tokens: a number is needed, not true"
    err = parse_openai(_openai(logprobs=True, top_logprobs=50), 1, DEFAULTS)
    assert err.message.startswith("body.top_logprobs: ") and "(got 50)" in err.message


def test_openai_unsupported_url_message_lists_supported():
    err = parse_openai(_openai(url="/v1/embeddings"), 1, DEFAULTS)
    assert "/v1/chat/completions" in err.message and "/v1/completions" in err.message


# --- formats ----------------------------------------------------------------------------------------
def test_format_detection(tmp_path):
    io = IOConfig()
    plain = _write_lines(tmp_path / "a.jsonl", [b"garbage", {"prompt": "x"}])
    openai = _write_lines(tmp_path / "b.jsonl", [_openai()])
    array = tmp_path / "c.json"
    array.write_text(json.dumps([{"prompt": "x"}]))
    lines_json = _write_lines(tmp_path / "d.json", [{"prompt": "x"}])
    assert detect_format(plain, io) == "jsonl"
    assert detect_format(openai, io) == "openai"
    assert detect_format(array, io) == "json"
    assert detect_format(lines_json, io) == "jsonl"
    assert detect_format(tmp_path / "x.parquet", io) == "parquet"
    assert detect_format(plain, IOConfig(input_format="openai")) == "openai"
    with pytest.raises(InputFileError, match="io.input_format"):
        detect_format(tmp_path / "x.txt", io)


def test_missing_input_file(tmp_path):
    with pytest.raises(InputFileError, match="no such file"):
        InputReader(tmp_path / "nope.jsonl", IOConfig(), DEFAULTS)
    with pytest.raises(InputFileError, match="is a directory"):
        InputReader(tmp_path, IOConfig(), DEFAULTS)


def test_a_broken_line_says_where_once(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "unterminated}\n')
    (item,) = _read(path)
    assert item.code == "invalid_json"
    assert item.message == "not valid JSON: Unterminated string starting at (column 23)"


def test_progress_rates_count_from_the_first_request(monkeypatch):
    """Setup before the first request (reading, forecasting) is not generation: the last line's
    rate is the summary's, where it read 24.6 against 101.3 tok/s for one run."""
    import io

    from batchinfer.runner import progress as progress_module

    now = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    progress = progress_module.Progress(4, mode="lines", stream=io.StringIO(), interval_s=1e9)
    now[0] = 103.0                   # three seconds of setup
    progress.begin()
    now[0] = 104.0
    progress.begin()                 # only the first request starts the clock
    now[0] = 105.0
    progress.update(4, 0, 200)
    assert progress.rate() == 100.0  # 200 tokens over the 2 s since the first request


def test_the_last_progress_line_says_how_the_job_ended():
    import io

    from batchinfer.runner.progress import Progress

    for outcome in ("finished", "interrupted"):
        stream = io.StringIO()
        progress = Progress(4, mode="lines", stream=stream)
        progress.close(outcome)
        assert f"batchinfer {outcome}: 0/4 requests" in stream.getvalue()


@pytest.mark.parametrize("suffix", ["parquet", "csv", "json", "arrow"])
def test_dataset_files(tmp_path, suffix):
    import datasets

    rows = {"question": ["What is 2+2?", "Name a color.", None], "qid": ["q1", "q2", "q3"],
            "topic": ["math", "art", "none"]}
    ds = datasets.Dataset.from_dict(rows)
    path = tmp_path / f"data.{suffix}"
    if suffix == "parquet":
        ds.to_parquet(str(path))
    elif suffix == "csv":
        ds.to_csv(str(path), index=False)
    elif suffix == "json":
        path.write_text(json.dumps([dict(zip(rows, vals)) for vals in zip(*rows.values())]))
    else:
        import pyarrow as pa

        with pa.OSFile(str(path), "wb") as sink:
            with pa.ipc.new_stream(sink, ds.data.table.schema) as writer:
                writer.write_table(ds.data.table)
    items = _read(path, prompt_field="question", id_field="qid", metadata_fields=["topic"])
    assert [type(i).__name__ for i in items] == ["RequestSpec", "RequestSpec", "InputError"]
    assert items[0].request_id == "q1" and items[0].prompt == "What is 2+2?"
    assert items[0].metadata == {"topic": "math"}
    assert items[2].line == 3
    # a CSV cell cannot be null, only empty (test_input_checks.py)
    assert items[2].code in (("empty_prompt",) if suffix == "csv" else ("invalid_type",
                                                                         "missing_prompt"))


def test_a_json_array_keeps_each_value_as_written(tmp_path):
    """Ids and prompts of mixed types across rows (arrow columns turned them into JSON-encoded
    strings); a value of the wrong type is that row's error; a non-object element is one too."""
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps([{"id": 1, "prompt": "What is 2+2?"}, {"id": "b2", "prompt": "hi"},
                                {"id": "c3", "prompt": 5}, "just a string",
                                {"id": "d4", "prompt": [11, 12]},
                                {"id": "e5", "prompt": "x", "topic": {"k": 1}}]))
    items = _read(path, metadata_fields=["topic"])
    assert items[0].request_id == "1" and items[0].prompt == "What is 2+2?"
    assert items[1].request_id == "b2" and items[1].prompt == "hi"
    assert items[2].code == "invalid_type" and items[2].line == 3
    assert items[3].code == "not_an_object" and items[3].line == 4
    assert items[4].prompt == [11, 12]                       # token ids
    assert items[5].metadata == {"topic": {"k": 1}}
    lines = _write_lines(tmp_path / "lines.jsonl", [{"text": "a", "uid": 7}, b"garbage"])
    items = _read(lines, input_format="json", prompt_field="text", id_field="uid")
    assert items[0].prompt == "a" and items[0].request_id == "7"
    assert items[1].code == "invalid_json" and items[1].line == 2
    broken = tmp_path / "broken.json"
    broken.write_text('[{"prompt": "a"}, ')
    with pytest.raises(InputFileError, match="not a valid JSON array"):
        _read(broken)


def test_dataset_row_errors_name_the_column_and_its_setting(tmp_path):
    """A CSV's empty prompt cell or repeated id is reported by the column the user named."""
    path = tmp_path / "d.csv"
    path.write_text('question,qid\n"",q1\nfine,q2\nagain,q2\n')
    items = _read(path, prompt_field="question", id_field="qid")
    assert items[0].code in ("empty_prompt", "invalid_type")     # the CSV reader's "" or null
    assert items[0].message.startswith("column 'question' (io.prompt_field) ")
    assert items[2].code == "duplicate_id" and "qid (io.id_field) 'q2'" in items[2].message


def test_duplicate_custom_ids_are_named_custom_id(tmp_path):
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "hi"}}
    items = _read(_write_lines(tmp_path / "batch.jsonl", [line, line]), input_format="openai")
    assert items[1].code == "duplicate_id"
    assert items[1].message.startswith("custom_id 'r1' appears on an earlier line")


def test_dataset_messages_column(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"conv": [[{"role": "user", "content": "hi"}]]})
    path = tmp_path / "chat.parquet"
    ds.to_parquet(str(path))
    (spec,) = _read(path, messages_field="conv")
    assert spec.messages == [{"role": "user", "content": "hi"}] and spec.request_id == "row-1"


def test_dataset_missing_column_names_the_setting(tmp_path):
    """A file with neither column is refused whole, before a model loads (every row would be
    the same error); a row whose prompt cell is missing is that row's error."""
    import datasets

    path = tmp_path / "d.parquet"
    datasets.Dataset.from_dict({"text": ["a", "b"]}).to_parquet(str(path))
    with pytest.raises(InputFileError, match=r"no 'prompt' or 'messages' column \(columns: text\);"
                                             r" set io.prompt_field"):
        _read(path)
    sparse = tmp_path / "s.parquet"
    datasets.Dataset.from_dict({"prompt": ["a", None]}).to_parquet(str(sparse))
    first, second = _read(sparse)
    assert first.prompt == "a" and second.code in ("missing_prompt", "invalid_type")
    assert "io.prompt_field" in second.message


# --- id set -----------------------------------------------------------------------------------------
def test_id_set_merges_and_finds():
    ids = IdSet(merge_at=7)
    for i in range(100):
        assert ids.add(f"id-{i}")
    assert not ids.add("id-5")
    assert len(ids) == 100
    assert all(f"id-{i}" in ids for i in range(100))
    assert "id-100" not in ids and 5 not in ids


def test_recipe_sampling_defaults_flow_into_specs(tmp_path):
    recipe = Recipe(sampling=SamplingParams(temperature=0.3, max_tokens=9))
    path = _write_lines(tmp_path / "in.jsonl", [{"prompt": "x"}])
    (spec,) = InputReader(path, recipe.io, recipe.sampling)
    assert spec.sampling.temperature == 0.3 and spec.sampling.max_tokens == 9


@pytest.mark.parametrize("shard", [Shard(), Shard(0, 2), Shard(1, 2)])
def test_the_record_count_is_what_the_reader_yields(tmp_path, shard):
    """Blank lines are no records (a finished job then has none remaining), a long line is one,
    a BOM alone is blank; the count matches the reader's for every shard."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\xef\xbb\xbf\n" + b'{"id": "a", "prompt": "Hi"}\n\n   \n'
                     + b'{"id": "b", "prompt": "' + b"x" * (3 << 20) + b'"}\n'
                     + b'{"id": "c", "prompt": "Yo"}\n\n{"id": "d", "prompt": "no newline"}')
    from batchinfer.runner.io.inputs import count_records

    reader = InputReader(path, IOConfig(max_line_bytes=1 << 20), SamplingParams(), shard=shard)
    assert count_records(path, "jsonl", shard) == len(list(reader)) == reader.total()
    if shard == Shard():
        assert reader.total() == 4


def test_an_id_whose_first_line_was_invalid_is_a_duplicate_on_a_later_line(tmp_path):
    """Ids are unique per input: the invalid line took it (its error record names it), so the
    later line is a duplicate, not a second record of the same id in outputs."""
    path = _write_lines(tmp_path / "in.jsonl", [{"id": "k", "prompt": ""},
                                                {"id": "k", "prompt": "Hi there"},
                                                {"id": "m", "prompt": "Hi"}])
    items = _read(path)
    assert [getattr(i, "code", "ok") for i in items] == ["empty_prompt", "duplicate_id", "ok"]
    reader = InputReader(path, IOConfig(), DEFAULTS)     # a resume that skips the reported line
    again = list(reader.records(done_lines=_id_set(["1"])))
    assert [getattr(i, "code", "ok") for i in again] == ["duplicate_id", "ok"]


def _id_set(values) -> IdSet:
    ids = IdSet()
    for value in values:
        ids.add(value)
    return ids


def test_a_jsonl_line_failing_under_a_recipe_naming_columns_says_where_they_apply(tmp_path):
    path = _write_lines(tmp_path / "in.jsonl", [{"uid": "a", "text": "Hello"}])
    (err,) = _read(path, prompt_field="text", id_field="uid")
    assert err.code == "unknown_key"
    assert "io.prompt_field: text, io.id_field: uid apply to dataset files" in err.message
    assert "io.input_format: json" in err.message
    (spec,) = _read(path, prompt_field="text", id_field="uid", input_format="json")
    assert spec.prompt == "Hello" and spec.request_id == "a"
    (plain,) = _read(_write_lines(tmp_path / "p.jsonl", [{"prompt": "x", "bogus": 1}]))
    assert "apply to dataset files" not in plain.message


def test_a_bad_token_id_prompt_names_the_item(tmp_path):
    path = _write_lines(tmp_path / "in.jsonl", [{"prompt": [1, 2.5, 3]}, {"prompt": []}])
    first, second = _read(path)
    assert first.message == "'prompt' is an array, so token ids (whole numbers), but item 1 is 2.5"
    assert second.code == "empty_prompt" and "empty array" in second.message


def test_openai_chat_logprobs_with_top_logprobs_null_give_the_sampled_tokens():
    """null means the default (0), as OpenAI and vLLM read it: logprobs true with top_logprobs
    null used to return no logprobs at all."""
    for body in ({"logprobs": True, "top_logprobs": None}, {"logprobs": True}):
        spec = parse_openai(_openai(**body), 1, DEFAULTS)
        assert isinstance(spec, RequestSpec) and spec.sampling.logprobs == 0, body
    assert parse_openai(_openai(logprobs=False, top_logprobs=None), 1,
                        DEFAULTS).sampling.logprobs is None


def test_vllm_sampling_keys_batchinfer_does_not_implement():
    """A line writing vLLM's default for one (a dump of vLLM's SamplingParams) runs; another value
    is unsupported_parameter naming it. They were unknown_key, with hints such as "did you mean
    'stop_token_ids'?" for allowed_token_ids, and a dump's defaults failed every line."""
    stated = {"prompt": "hi", "logit_bias": None, "allowed_token_ids": None, "bad_words": [],
              "prompt_logprobs": None, "spaces_between_special_tokens": True, "detokenize": True}
    spec = parse_plain_or_chat(stated, 1, DEFAULTS)
    assert isinstance(spec, RequestSpec) and spec.sampling == DEFAULTS
    for key, value in [("spaces_between_special_tokens", False), ("detokenize", False)]:
        err = parse_plain_or_chat({"prompt": "hi", key: value}, 3, DEFAULTS)
        assert isinstance(err, InputError) and err.code == "unsupported_parameter", key
        assert err.message.startswith(f"{key} is a vLLM sampling parameter batchinfer does not "
                                      "implement"), err.message
    err = parse_openai(_openai(detokenize=False), 1, DEFAULTS)
    assert err.code == "unsupported_parameter" and err.message.startswith("body.detokenize")
    assert not isinstance(parse_openai(_openai(prompt_logprobs=None, bad_words=[],
                                               detokenize=True), 1, DEFAULTS), InputError)


def test_bad_words_reach_the_sampling():
    """vLLM's bad_words on a line and in an OpenAI body (vLLM's server takes it there); [] is
    its default, repeats count once; an empty word is the line's invalid_sampling."""
    spec = parse_plain_or_chat({"prompt": "hi", "bad_words": ["Paris", "Rome", "Paris"]}, 1,
                               DEFAULTS)
    assert spec.sampling.bad_words == ["Paris", "Rome"]
    assert parse_openai(_openai(bad_words=["x"]), 1, DEFAULTS).sampling.bad_words == ["x"]
    assert parse_plain_or_chat({"prompt": "hi", "bad_words": []}, 1,
                               DEFAULTS).sampling.bad_words is None
    err = parse_openai(_openai(bad_words=["ok", ""]), 1, DEFAULTS)
    assert err.code == "invalid_sampling" and err.message.startswith("body.bad_words: ")
    assert "cannot contain an empty string" in err.message


def test_logit_bias_and_allowed_token_ids_reach_the_sampling():
    """vLLM's logit_bias (JSON writes its ids as strings) and allowed_token_ids, on a line and
    in an OpenAI body (its biases held to OpenAI's -100..100, as vLLM's server holds them)."""
    spec = parse_plain_or_chat({"prompt": "hi", "logit_bias": {"5": -3.5},
                                "allowed_token_ids": [5, 9]}, 1, DEFAULTS)
    assert spec.sampling.logit_bias == {5: -3.5} and spec.sampling.allowed_token_ids == [5, 9]
    spec = parse_openai(_openai(logit_bias={"7": 250, "8": -1}), 1, DEFAULTS)
    assert spec.sampling.logit_bias == {7: 100.0, 8: -1.0}
    err = parse_plain_or_chat({"prompt": "hi", "logit_bias": {"x": 1}}, 2, DEFAULTS)
    assert err.code == "invalid_sampling" and "logit_bias.x" in err.message
    err = parse_openai(_openai(allowed_token_ids=[]), 1, DEFAULTS)
    assert err.code == "invalid_sampling" and err.message.startswith("body.allowed_token_ids")


def test_n_samples_from_every_place_a_line_can_set_it():
    """n (samples of the reply, vLLM's parallel sampling) from a plain line, a chat line, an
    OpenAI body of either URL and the recipe's defaults; 0, a fraction, true or past vLLM's
    limit is the line's invalid_sampling naming the key as the line wrote it."""
    assert parse_plain_or_chat({"prompt": "hi", "n": 4}, 1, DEFAULTS).sampling.n == 4
    chat = parse_plain_or_chat({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 1,
                               DEFAULTS)
    assert chat.sampling.n == 2 and "n" in chat.sampling_keys
    assert parse_openai(_openai(n=3), 1, DEFAULTS).sampling.n == 3
    assert parse_openai(_openai("/v1/completions", prompt="hi", n=5), 1, DEFAULTS).sampling.n == 5
    assert parse_openai(_openai(n=None), 1, DEFAULTS).sampling.n == 1      # null: the default
    assert parse_plain_or_chat({"prompt": "hi"}, 1, SamplingParams(n=6)).sampling.n == 6
    for value, said in [(0, "must be 1..16384"), (16385, "must be 1..16384"),
                        (1.5, "valid integer"), (True, "a number is needed, not true")]:
        err = parse_openai(_openai(n=value), 7, DEFAULTS)
        assert isinstance(err, InputError) and err.code == "invalid_sampling", value
        assert err.message.startswith("body.n: ") and said in err.message, err.message
    err = parse_plain_or_chat({"prompt": "hi", "n": 0}, 2, DEFAULTS)
    assert err.message == ("n: the number of samples of the reply must be 1..16384 (vLLM's "
                           "limit, VLLM_MAX_N_SEQUENCES) (got 0)")


def test_unknown_key_messages_do_not_list_vllm_keys_batchinfer_does_not_implement():
    err = parse_plain_or_chat({"prompt": "hi", "temprature": 0, "detokenize": True}, 1,
                              DEFAULTS)
    assert err.code == "unknown_key" and "'temprature' (did you mean 'temperature'?)" in err.message
    assert "spaces_between" not in err.message and "detokenize" not in err.message
    err = parse_openai(_openai(temprature=0, detokenize=True), 1, DEFAULTS)
    assert err.code == "unknown_key" and "detokenize" not in err.message


def test_embedding_jobs_each_warn_of_ignored_openai_body_keys_once(tmp_path, caplog):
    """Body keys /v1/embeddings ignores (as vLLM's server does) are said once per key and job:
    a second job in the same process (the Python API) says them again."""
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST",
                                        "url": "/v1/embeddings",
                                        "body": {"input": "x", "temperature": 0.2}}) + "\n"
                            for i in range(3)))
    for job in range(2):
        caplog.clear()
        reader = InputReader(path, IOConfig(), DEFAULTS, embed=True)
        assert all(isinstance(item, RequestSpec) for item in reader.records())
        said = [r.getMessage() for r in caplog.records if "temperature" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith("line 1: body key(s) temperature are "
                                                     "ignored: they do not change an "
                                                     "embedding"), job
