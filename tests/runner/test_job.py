"""The job loop end to end on the tiny dummy-weight engine (in process, one engine shared)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchinfer.runner.job import EXIT_OK, JobSpec, run_job
from batchinfer.runner.recipe import Recipe
from batchinfer.engine.request import SamplingParams

REPO = Path(__file__).resolve().parents[2]
# a 2-layer dummy-weight model with the default tokenizer: fast enough for any test
TINY_MODEL = {"load_format": "dummy", "max_model_len": 512, "hf_overrides": {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}}


@pytest.fixture(scope="module")
def tiny_recipe():
    return Recipe(model=TINY_MODEL, memory={"kv_cache_memory": "16MiB"},
                  sampling=SamplingParams(max_tokens=6, temperature=0.7, seed=1),
                  strategy={"name": "baseline", "max_num_seqs": 8},
                  report={"refresh_seconds": 0.2, "plots": False, "metrics_interval_seconds": 0.1})


@pytest.fixture(scope="module")
def shared_engine(tiny_recipe):
    from batchinfer.engine.engine import Engine

    return Engine.from_config(tiny_recipe.engine_config())


def run(recipe, input_path, out_dir, engine, **kw):
    spec = JobSpec(recipe=recipe, input_path=Path(input_path), output_dir=Path(out_dir),
                   progress="off", engine_factory=lambda cfg: engine, **kw)
    return run_job(spec)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def write_jsonl(path: Path, lines: list) -> Path:
    raw = [line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines]
    path.write_bytes(b"\n".join(raw) + b"\n")
    return path


def mixed_bad_input(path: Path) -> tuple[Path, set[str], dict[int, str]]:
    """The issue's bad-input file: valid lines mixed with every kind of bad line."""
    good = lambda i, **kw: {"id": f"good-{i}", "prompt": f"Tell me about the number {i}.", **kw}  # noqa: E731
    lines = [
        good(1),
        b'{"id": "broken", "prompt": "x"',                             # 2 invalid JSON
        b"[1, 2, 3]",                                                  # 3 not an object
        {"id": "no-prompt"},                                           # 4 missing prompt/messages
        {"id": "wrong-type", "prompt": 42},                            # 5 wrong type
        {"id": "unknown-key", "prompt": "hi", "temprature": 0.5},      # 6 unknown sampling key
        {"id": "neg-temp", "prompt": "hi", "temperature": -1},         # 7 temperature < 0
        {"id": "top-p", "prompt": "hi", "top_p": 1.5},                 # 8 top_p > 1
        {"id": "zero-tokens", "prompt": "hi", "max_tokens": 0},        # 9 max_tokens 0
        good(2, metadata={"source": "unit", "n": [1, 2]}),             # 10
        good(1),                                                       # 11 duplicate id
        {"id": "empty", "prompt": ""},                                 # 12 empty prompt
        {"id": "too-long", "prompt": "word " * 2000},                  # 13 longer than max_model_len
        {"id": "huge", "prompt": "x" * (5 * 2**20)},                   # 14 a 5 MB line
        b'{"id": "bad-utf8", "prompt": "caf\xc3\x28"}',                # 15 invalid UTF-8
        {"id": "chat", "messages": [{"role": "user", "content": "Hi!"}]},  # 16
        good(3, max_tokens=3),                                         # 17
    ]
    write_jsonl(path, lines)
    expected_errors = {2: "invalid_json", 3: "not_an_object", 4: "missing_prompt",
                       5: "invalid_type", 6: "unknown_key", 7: "invalid_sampling",
                       8: "invalid_sampling", 9: "invalid_sampling", 11: "duplicate_id",
                       12: "empty_prompt", 13: "prompt_too_long", 14: "line_too_long",
                       15: "invalid_utf8"}
    return path, {"good-1", "good-2", "chat", "good-3"}, expected_errors


def test_bad_input_every_line_accounted_for(tmp_path, tiny_recipe, shared_engine):
    path, good_ids, expected_errors = mixed_bad_input(tmp_path / "bad.jsonl")
    outcome = run(tiny_recipe, path, tmp_path / "run", shared_engine)
    assert outcome.status == "completed" and outcome.exit_code == EXIT_OK
    outputs = read_jsonl(tmp_path / "run" / "outputs.jsonl")
    errors = read_jsonl(tmp_path / "run" / "errors.jsonl")
    assert {o["id"] for o in outputs} == good_ids and len(outputs) == len(good_ids)
    assert {e["line"]: e["code"] for e in errors} == expected_errors
    assert all(e["message"] for e in errors)
    by_id = {o["id"]: o for o in outputs}
    assert by_id["good-2"]["metadata"] == {"source": "unit", "n": [1, 2]}
    assert by_id["good-3"]["completion_tokens"] <= 3
    for o in outputs:
        assert o["finish_reason"] in ("stop", "length") and o["prompt_tokens"] > 0
        assert isinstance(o["text"], str)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "completed"
    assert report["totals"]["outputs"] == 4 and report["totals"]["errors"] == 13
    assert report["totals"]["errors_by_code"]["invalid_sampling"] == 3


def test_report_and_run_files(tmp_path, tiny_recipe, shared_engine):
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"Question {i}?"}
                                               for i in range(20)])
    recipe = tiny_recipe.model_copy(update={"report": tiny_recipe.report.model_copy(
        update={"plots": True, "plot_refresh_seconds": 60})})
    outcome = run(recipe, path, tmp_path / "run", shared_engine)
    run_dir = tmp_path / "run"
    assert outcome.outputs == 20 and outcome.errors == 0
    for name in ("outputs.jsonl", "report.json", "report.md", "metrics.jsonl",
                 "recipe.resolved.yaml", "run.json", "plots/throughput.png",
                 "plots/kv_usage.png", "plots/batch_sizes.png"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "plots/throughput.png").read_bytes()[:4] == b"\x89PNG"
    report = json.loads((run_dir / "report.json").read_text())
    session = report["session"]
    tp = session["throughput"]
    assert tp["requests_per_s"] > 0 and tp["output_tokens_per_s"] > 0
    assert tp["total_tokens_per_s"] == pytest.approx(tp["input_tokens_per_s"]
                                                     + tp["output_tokens_per_s"], rel=0.01)
    assert session["latency_s"]["e2e"]["count"] == 20
    assert session["latency_s"]["e2e"]["p50"] <= session["latency_s"]["e2e"]["p99"]
    assert session["kv"]["capacity_tokens"] > 0 and session["kv"]["usage_max"] > 0
    assert session["batch_size"]["max"] <= 8
    assert {"load", "input", "write"} <= set(session["phases_s"])
    assert "output_tokens_per_s" in report["definitions"]
    md = (run_dir / "report.md").read_text()
    assert "## Throughput" in md and "output tok/s" in md and "plots/throughput.png" in md
    samples = read_jsonl(run_dir / "metrics.jsonl")
    assert samples and all(s["session"] == 1 for s in samples)
    assert sum(s["requests_done"] for s in samples) == 20
    resolved = (run_dir / "recipe.resolved.yaml").read_text()
    assert "max_num_seqs: 8" in resolved


def test_resume_continues_and_never_repeats(tmp_path, tiny_recipe, shared_engine):
    lines = [{"id": f"r{i}", "prompt": f"Question {i}?"} for i in range(12)] + [b"not json"]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    first = run(tiny_recipe, path, tmp_path / "run", shared_engine, limit=5)
    assert first.outputs == 5
    second = run(tiny_recipe, path, tmp_path / "run", shared_engine)
    assert second.outputs == 12 and second.errors == 1
    third = run(tiny_recipe, path, tmp_path / "run", shared_engine)
    assert third.session["requests_completed"] == 0 and third.session["requests_failed"] == 0
    ids = [o["id"] for o in read_jsonl(tmp_path / "run" / "outputs.jsonl")]
    assert sorted(ids) == sorted(f"r{i}" for i in range(12))
    assert len(read_jsonl(tmp_path / "run" / "errors.jsonl")) == 1
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    # the third session ran nothing: the report's session is still the second (run.json has all)
    assert len(report["previous_sessions"]) == 1
    assert report["session"]["requests_completed"] == 7
    assert report["totals"]["outputs"] == 12
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    assert len(manifest["sessions"]) == 3


def test_output_order_input(tmp_path, tiny_recipe, shared_engine):
    recipe = tiny_recipe.model_copy(update={"io": tiny_recipe.io.model_copy(
        update={"output_order": "input", "max_in_flight": 6})})
    # long and short requests interleaved finish out of order; the file must not be
    lines = [{"id": f"r{i}", "prompt": "Tell me a story.", "max_tokens": 12 if i % 2 else 2,
              "ignore_eos": True} for i in range(14)]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    run(recipe, path, tmp_path / "run", shared_engine)
    ids = [o["id"] for o in read_jsonl(tmp_path / "run" / "outputs.jsonl")]
    assert ids == [f"r{i}" for i in range(14)]


def test_completion_order_is_the_default(tmp_path, tiny_recipe, shared_engine):
    lines = [{"id": "long", "prompt": "Tell me a story.", "max_tokens": 30, "ignore_eos": True},
             {"id": "short", "prompt": "Hi", "max_tokens": 1}]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    run(tiny_recipe, path, tmp_path / "run", shared_engine)
    ids = [o["id"] for o in read_jsonl(tmp_path / "run" / "outputs.jsonl")]
    assert ids == ["short", "long"]


def test_openai_batch_input(tmp_path, tiny_recipe, shared_engine):
    outcome = run(tiny_recipe, REPO / "examples" / "quickstart_openai.jsonl", tmp_path / "run",
                  shared_engine)
    assert outcome.outputs == 4
    records = read_jsonl(tmp_path / "run" / "outputs.jsonl")
    assert {r["custom_id"] for r in records} == {"req-1", "req-2", "req-3", "req-4"}
    for r in records:
        body = r["response"]["body"]
        assert r["response"]["status_code"] == 200 and r["error"] is None
        assert body["usage"]["total_tokens"] == (body["usage"]["prompt_tokens"]
                                                 + body["usage"]["completion_tokens"])
        assert body["object"] in ("chat.completion", "text_completion")


def test_openai_bad_lines_get_openai_error_records(tmp_path, tiny_recipe, shared_engine):
    lines = [{"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}]}},
             {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
             {"custom_id": "get", "method": "GET", "url": "/v1/chat/completions", "body": {}}]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    outcome = run(tiny_recipe, path, tmp_path / "run", shared_engine)
    assert outcome.exit_code == EXIT_OK and outcome.outputs == 1
    errors = read_jsonl(tmp_path / "run" / "errors.jsonl")
    assert {(e["custom_id"], e["code"], e["line"]) for e in errors} == {
        ("emb", "unsupported_url", 2), ("get", "unsupported_method", 3)}
    assert all(e["response"] is None and e["error"]["code"] == e["code"] for e in errors)


def test_a_repeated_custom_id_gets_its_own_batch_request_id(tmp_path, tiny_recipe, shared_engine):
    """Downstream tools key OpenAI batch output by `id`: the duplicate's error record must not
    carry the first line's."""
    line = {"custom_id": "same", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "hi", "max_tokens": 2}}
    path = write_jsonl(tmp_path / "in.jsonl", [line, line])
    run(tiny_recipe, path, tmp_path / "run", shared_engine)
    (output,) = read_jsonl(tmp_path / "run" / "outputs.jsonl")
    (error,) = read_jsonl(tmp_path / "run" / "errors.jsonl")
    assert error["code"] == "duplicate_id" and error["custom_id"] == "same"
    assert error["id"].startswith("batch_req_") and error["id"] != output["id"]


def test_an_openai_lines_stop_ids_past_the_vocabulary_are_named_under_body(
        tmp_path, tiny_recipe, shared_engine):
    """The engine refuses them as it admits the request; the error record names the key where
    the line holds it, as the reader's own messages do."""
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "far", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "hi", "stop_token_ids": [10 ** 9]}}])
    run(tiny_recipe, path, tmp_path / "run", shared_engine)
    (error,) = read_jsonl(tmp_path / "run" / "errors.jsonl")
    assert error["code"] == "invalid_sampling"
    assert error["error"]["message"].startswith("body.stop_token_ids: [1000000000] out of range")


def test_chat_template_modes(tmp_path, tiny_recipe, shared_engine):
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "p", "prompt": "Hello"}])
    counts = {}
    for mode in ("auto", "always"):
        recipe = tiny_recipe.model_copy(update={"io": tiny_recipe.io.model_copy(
            update={"chat_template": mode})})
        run(recipe, path, tmp_path / mode, shared_engine)
        (record,) = read_jsonl(tmp_path / mode / "outputs.jsonl")
        counts[mode] = record["prompt_tokens"]
    assert counts["always"] > counts["auto"]  # the template adds role markers


def test_dataset_input(tmp_path, tiny_recipe, shared_engine):
    import datasets

    path = tmp_path / "data.parquet"
    datasets.Dataset.from_dict({"text": ["What is a cat?", "What is a dog?"],
                                "key": ["a", "b"]}).to_parquet(str(path))
    recipe = tiny_recipe.model_copy(update={"io": tiny_recipe.io.model_copy(
        update={"prompt_field": "text", "id_field": "key", "metadata_fields": ["key"]})})
    outcome = run(recipe, path, tmp_path / "run", shared_engine)
    assert outcome.outputs == 2
    records = read_jsonl(tmp_path / "run" / "outputs.jsonl")
    assert {r["id"] for r in records} == {"a", "b"}
    assert all(r["metadata"] == {"key": r["id"]} for r in records)


def test_logprobs_are_written(tmp_path, tiny_recipe, shared_engine):
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "lp", "prompt": "Hi", "logprobs": 2,
                                                "max_tokens": 3, "ignore_eos": True}])
    run(tiny_recipe, path, tmp_path / "run", shared_engine)
    (record,) = read_jsonl(tmp_path / "run" / "outputs.jsonl")
    assert len(record["logprobs"]) == 3
    assert len(record["logprobs"][0]["top_logprobs"]) == 2


def test_logprob_tokens_are_text_and_their_bytes_rebuild_the_reply(tmp_path, tiny_recipe,
                                                                   shared_engine):
    """The tokens' own bytes, joined, are the reply's text (special tokens aside), in the plain
    record and in the OpenAI envelope's `bytes` alike; no entry shows a vocabulary piece."""
    tok = shared_engine.tokenizer
    special = {tok.token_text(i) for i in tok.hf.all_special_ids}
    sampling = {"max_tokens": 12, "ignore_eos": True, "temperature": 0}
    plain = write_jsonl(tmp_path / "in.jsonl", [{"id": "lp", "prompt": "Say something long",
                                                 "logprobs": 2, **sampling}])
    run(tiny_recipe, plain, tmp_path / "plain", shared_engine)
    (record,) = read_jsonl(tmp_path / "plain" / "outputs.jsonl")
    entries = [e for e in record["logprobs"] if e["token"] not in special]
    assert bytes(b for e in entries for b in e["bytes"]).decode("utf-8") == record["text"]
    assert not any(ch in e["token"] for e in record["logprobs"] for ch in "Ġ▁")

    batch = write_jsonl(tmp_path / "batch.jsonl", [{
        "custom_id": "lp", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "Say something long"}],
                 "logprobs": True, "top_logprobs": 2, **sampling}}])
    run(tiny_recipe, batch, tmp_path / "openai", shared_engine)
    (envelope,) = read_jsonl(tmp_path / "openai" / "outputs.jsonl")
    choice = envelope["response"]["body"]["choices"][0]
    content = [e for e in choice["logprobs"]["content"] if e["token"] not in special]
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8") \
        == choice["message"]["content"]


def test_prompt_logprobs_are_written_in_every_output_form(tmp_path, tiny_recipe, shared_engine):
    """A plain line's record lists one entry per prompt token (null first, then the token's
    logprob_entry with its rank); the OpenAI envelope carries vLLM's server form, on the chat
    response's body and on a completion's choice, the same numbers; a line without the key
    gets none."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = shared_engine.tokenizer.encode(prompt)
    sampling = {"max_tokens": 2, "temperature": 0}
    plain = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "plp", "prompt": prompt, "prompt_logprobs": 3, **sampling},
        {"id": "none", "prompt": prompt, **sampling}])
    run(tiny_recipe, plain, tmp_path / "plain", shared_engine)
    records = {r["id"]: r for r in read_jsonl(tmp_path / "plain" / "outputs.jsonl")}
    entries = records["plp"]["prompt_logprobs"]
    assert "prompt_logprobs" not in records["none"]
    assert entries[0] is None and [e["token_id"] for e in entries[1:]] == ids[1:]
    assert list(entries[1]) == ["token_id", "token", "bytes", "logprob", "rank", "top_logprobs"]
    assert all(len(e["top_logprobs"]) == 3 and e["rank"] >= 1 for e in entries[1:])

    batch = write_jsonl(tmp_path / "batch.jsonl", [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": prompt}], "prompt_logprobs": 1,
                  **sampling}},
        {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": prompt, "prompt_logprobs": 3, **sampling}}])
    run(tiny_recipe, batch, tmp_path / "openai", shared_engine)
    bodies = {r["custom_id"]: r["response"]["body"]
              for r in read_jsonl(tmp_path / "openai" / "outputs.jsonl")}
    chat = bodies["chat"]["prompt_logprobs"]
    assert chat[0] is None and len(chat) == bodies["chat"]["usage"]["prompt_tokens"]
    assert "prompt_logprobs" not in bodies["chat"]["choices"][0]
    server = bodies["cmpl"]["choices"][0]["prompt_logprobs"]
    assert server[0] is None and len(server) == len(entries)
    for position, entry in zip(server[1:], entries[1:]):
        first = next(iter(position))
        assert first == str(entry["token_id"])
        assert position[first]["logprob"] == pytest.approx(entry["logprob"], abs=1e-5)
        assert position[first]["decoded_token"] == entry["token"]
        top_ids = [str(t["token_id"]) for t in entry["top_logprobs"]]
        listed = [k for k in position if k != first or k in top_ids]   # the top, ranks 1..3
        assert sorted(listed, key=lambda k: position[k]["rank"]) == top_ids


def test_shards_split_the_work(tmp_path, tiny_recipe, shared_engine):
    from batchinfer.runner.io.inputs import Shard

    path = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"Q{i}"} for i in range(9)])
    for index in range(3):
        run(tiny_recipe, path, tmp_path / "run", shared_engine, shard=Shard(index, 3))
    ids = []
    for index in range(3):
        part = tmp_path / "run" / f"part-{index:05d}-of-00003"
        ids += [o["id"] for o in read_jsonl(part / "outputs.jsonl")]
        assert json.loads((part / "report.json").read_text())["shard"] == {"index": index, "count": 3}
    assert sorted(ids) == sorted(f"r{i}" for i in range(9))


def test_a_part_must_match_the_parts_already_in_its_run(tmp_path, tiny_recipe, shared_engine):
    """`report` merges a Slurm run's parts into one, so a part started with another input,
    model or sampling than a part that holds results is refused before it writes its files,
    naming that part (--dry-run too); a part with no results yet constrains nothing (a first
    start that stopped before any request, corrected); the same input grown between the
    parts' starts is one input; --force-resume lets it run."""
    from typer.testing import CliRunner

    from batchinfer.cli.main import app
    from batchinfer.runner.io.inputs import Shard
    from batchinfer.runner.run_dir import RunDirError

    rows = [{"id": f"r{i}", "prompt": f"Q{i}"} for i in range(6)]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    path_bytes = path.stat().st_size
    out = tmp_path / "run"
    longer = tiny_recipe.model_copy(update={"sampling": tiny_recipe.sampling.model_copy(
        update={"max_tokens": 9})})
    run(longer, path, out, shared_engine, shard=Shard(0, 2), limit=0)   # started, ran nothing
    assert (out / "part-00000-of-00002" / "run.json").is_file()
    run(tiny_recipe, path, out, shared_engine, shard=Shard(1, 2))       # the corrected recipe
    run(tiny_recipe, path, out, shared_engine, shard=Shard(0, 2))
    other = write_jsonl(tmp_path / "other.jsonl", [{"id": "x", "prompt": "other"}])
    fresh = tmp_path / "fresh"
    run(tiny_recipe, path, fresh, shared_engine, shard=Shard(0, 2))
    with pytest.raises(RunDirError, match=r"part-00000-of-00002 \(another part of this Slurm "
                                          r"run\) holds results made from another input: .*in"
                                          r"\.jsonl .*report. would merge"):
        run(tiny_recipe, other, fresh, shared_engine, shard=Shard(1, 2))
    with pytest.raises(RunDirError, match=r"made from other settings \(sampling\.max_tokens: "
                                          r"6 -> 9\)"):
        run(longer, path, fresh, shared_engine, shard=Shard(1, 2))
    refused = fresh / "part-00001-of-00002"
    assert not any((refused / name).exists() for name in ("run.json", "recipe.resolved.yaml",
                                                          "outputs.jsonl"))
    recipe = tmp_path / "longer.yaml"
    recipe.write_text(longer.to_yaml())
    result = CliRunner().invoke(app, ["run", str(recipe), "--input", str(path), "--output",
                                      str(fresh), "--shard", "1/2", "--dry-run"])
    assert result.exit_code == 2 and "another part of this Slurm run" in result.output
    grown = write_jsonl(tmp_path / "in.jsonl", rows + [{"id": "r6", "prompt": "Q6"}])
    assert run(tiny_recipe, grown, fresh, shared_engine, shard=Shard(1, 2)).outputs == 3
    # a part that read the input before it grew checks a part that recorded it grown: the
    # input is read again over the recorded length
    from batchinfer.runner.resume_check import check_other_parts, fingerprint

    before_growth = fingerprint(grown, path_bytes)
    check_other_parts(fresh / "part-00000-of-00002", tiny_recipe, grown, before_growth)
    forced = run(longer, grown, fresh, shared_engine, shard=Shard(0, 2), force_resume=True)
    assert forced.session["requests_completed"] == 1      # r6, the grown line of part 0


def test_resume_needs_the_inputs_first_bytes_and_the_same_model(tmp_path, tiny_recipe,
                                                                 shared_engine):
    """A file without ids numbers its lines, so another file (or an edited line) resumed into the
    same directory would have its requests skipped as done: refused before anything is written,
    as is another model; lines appended to the input continue the run; --force-resume skips by
    ids as before; a directory written before the input's digest was recorded still resumes."""
    from batchinfer.runner.run_dir import RunDirError

    first = [{"prompt": f"First file, question {i}?"} for i in range(3)]
    path = write_jsonl(tmp_path / "a.jsonl", first)
    out = tmp_path / "run"
    assert run(tiny_recipe, path, out, shared_engine).outputs == 3
    before = {name: (out / name).read_bytes()
              for name in ("outputs.jsonl", "run.json", "recipe.resolved.yaml")}

    other = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"Second file {i}"} for i in range(4)])
    edited = write_jsonl(tmp_path / "edited.jsonl", [{"prompt": "Changed?"}] + first[1:])
    shorter = write_jsonl(tmp_path / "short.jsonl", first[:2])
    for changed in (other, edited, shorter):
        with pytest.raises(RunDirError, match="--force-resume"):
            run(tiny_recipe, changed, out, shared_engine)
    reseeded = tiny_recipe.model_copy(update={"model": tiny_recipe.model.model_copy(
        update={"seed": 7})})
    with pytest.raises(RunDirError, match=r"model\.seed: 0 -> 7"):
        run(reseeded, path, out, shared_engine)
    longer = tiny_recipe.model_copy(update={"sampling": tiny_recipe.sampling.model_copy(
        update={"max_tokens": 9})})               # another recipe of the same file name, say
    with pytest.raises(RunDirError, match=r"sampling\.max_tokens: 6 -> 9.*another --output"):
        run(longer, path, out, shared_engine)
    templated = tiny_recipe.model_copy(update={"io": tiny_recipe.io.model_copy(
        update={"chat_template": "never"})})
    with pytest.raises(RunDirError, match=r"io\.chat_template: auto -> never"):
        run(templated, path, out, shared_engine)
    renamed_ids = tiny_recipe.model_copy(update={"io": tiny_recipe.io.model_copy(
        update={"id_field": "uid"})})             # every record's id would change
    with pytest.raises(RunDirError, match=r"io\.id_field: id -> uid"):
        run(renamed_ids, path, out, shared_engine)
    assert {name: (out / name).read_bytes() for name in before} == before

    grown = write_jsonl(tmp_path / "grown.jsonl", first + [{"prompt": "One more?"}])
    resumed = run(tiny_recipe, grown, out, shared_engine)
    assert resumed.session["requests_completed"] == 1 and resumed.outputs == 4

    forced = run(tiny_recipe, other, out, shared_engine, force_resume=True)
    assert forced.session["requests_completed"] == 0      # line-1..4 are done: ids decide
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["input"] == str(other.resolve())
    del manifest["input_fingerprint"]                       # as an earlier version wrote it
    (out / "run.json").write_text(json.dumps(manifest))
    assert run(tiny_recipe, edited, out, shared_engine).exit_code == EXIT_OK


def test_fingerprint_of_a_prefix_equals_the_prefix_files(tmp_path):
    from batchinfer.runner.resume_check import CHUNK, fingerprint

    data = bytes(range(256)) * (3 * CHUNK // 256 + 7)
    (tmp_path / "whole").write_bytes(data)
    cut = 2 * CHUNK + 13
    (tmp_path / "prefix").write_bytes(data[:cut])
    assert fingerprint(tmp_path / "whole", cut) == fingerprint(tmp_path / "prefix")
    assert fingerprint(tmp_path / "whole")["bytes"] == len(data)
    assert fingerprint(tmp_path / "whole", len(data) + 5) == fingerprint(tmp_path / "whole")


def test_one_read_gives_the_prefix_and_the_whole_fingerprint(tmp_path):
    """fingerprint_with_prefix: the two fingerprints a resume needs, as two reads give them, at
    a prefix inside a chunk, on a chunk's edge, past the end, empty, and none asked for."""
    from batchinfer.runner.resume_check import CHUNK, fingerprint, fingerprint_with_prefix

    path = tmp_path / "input"
    path.write_bytes(bytes(range(256)) * (2 * CHUNK // 256 + 3))
    whole = fingerprint(path)
    for prefix in (0, 17, CHUNK, CHUNK + 5, whole["bytes"], whole["bytes"] + 9):
        assert fingerprint_with_prefix(path, prefix) == (fingerprint(path, prefix), whole)
    assert fingerprint_with_prefix(path, None) == (None, whole)


def test_nothing_to_run_loads_no_model(tmp_path, tiny_recipe, shared_engine, caplog):
    """An empty input (or only blank lines) warns and completes without building the engine, and
    so does a resume that finds every request already written."""
    def no_engine(cfg):
        raise AssertionError("the engine was built")

    def run_without_engine(path, out):
        spec = JobSpec(recipe=tiny_recipe, input_path=path, output_dir=out, progress="off",
                       engine_factory=no_engine)
        return run_job(spec)

    for name, content in (("empty", b""), ("blank", b"\n  \n\n")):
        (tmp_path / f"{name}.jsonl").write_bytes(content)
        with caplog.at_level("WARNING", logger="batchinfer"):
            outcome = run_without_engine(tmp_path / f"{name}.jsonl", tmp_path / name)
        assert outcome.exit_code == EXIT_OK and outcome.outputs == 0
        assert "holds no requests" in caplog.text
        assert json.loads((tmp_path / name / "report.json").read_text())["status"] == "completed"
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Question {i}?"} for i in range(3)])
    assert run(tiny_recipe, path, tmp_path / "run", shared_engine).outputs == 3
    again = run_without_engine(path, tmp_path / "run")
    assert again.exit_code == EXIT_OK and again.outputs == 3


def test_a_resume_compares_the_model_path_by_where_it_leads(tmp_path, monkeypatch):
    """run.json records the model's path resolved: the same model spelt relative or absolute, or
    reached from another directory, resumes; the same spelling leading elsewhere is refused,
    naming both places. A run.json from before the record compares the recipe's spelling, or the
    absolute path it leads to now."""
    import yaml

    from batchinfer.engine.config import ModelConfig
    from batchinfer.runner.resume_check import check_model, model_locations
    from batchinfer.runner.run_dir import RunDirError

    for place in ("a", "b"):
        (tmp_path / place / "models" / "m").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a")
    relative = ModelConfig(path="models/m")
    old_yaml = yaml.safe_dump({"model": relative.model_dump(mode="json")})
    recorded = model_locations(relative)
    assert recorded["path"] == str(tmp_path / "a" / "models" / "m")
    absolute = ModelConfig(path=str(tmp_path / "a" / "models" / "m"))
    check_model(tmp_path, old_yaml, absolute, recorded)               # same model, spelt otherwise
    check_model(tmp_path, old_yaml, absolute, None)                   # no record: leads there
    check_model(tmp_path, old_yaml, relative, None)                   # no record: same spelling
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(RunDirError, match=r"model\.path: '.*/a/models/m' -> '.*/b/models/m'"):
        check_model(tmp_path, old_yaml, relative, recorded)           # same spelling, elsewhere
    check_model(tmp_path, old_yaml, absolute, recorded)               # from another directory
    with pytest.raises(RunDirError, match="another model"):
        check_model(tmp_path, old_yaml, ModelConfig(path=str(tmp_path / "b" / "models" / "m")),
                    recorded)
    # one absolute path that links to node-local storage (another target on each node of a
    # Slurm run) is one model
    link = tmp_path / "node-local-model"
    link.symlink_to(tmp_path / "a" / "models" / "m")
    linked = ModelConfig(path=str(link))
    linked_yaml = yaml.safe_dump({"model": linked.model_dump(mode="json")})
    linked_at = model_locations(linked)
    link.unlink()
    link.symlink_to(tmp_path / "b" / "models" / "m")
    assert model_locations(linked) != linked_at
    check_model(tmp_path, linked_yaml, linked, linked_at)


def test_an_input_file_that_breaks_part_way_keeps_what_ran_and_exits_2(tmp_path, tiny_recipe,
                                                                       shared_engine,
                                                                       monkeypatch):
    """A CSV row the reader cannot parse past its first chunk: the records before it are
    written, the job stops with exit 2 and says to mend the file (not "rerun to resume" alone:
    a rerun of the same file stops there again); an unreadable file stops before anything."""
    from batchinfer.runner.io import inputs
    from batchinfer.runner.io.inputs import InputFileError
    from batchinfer.runner.job import EXIT_USAGE

    path = tmp_path / "in.csv"
    path.write_text("id,prompt\nr0,Hi\nr1,Yo\nr2,Hey\n")
    real = inputs.iter_dataset_rows

    def breaks_after_two(path, fmt, shard=inputs.Shard()):
        for number, row in real(path, fmt, shard):
            if number == 3:
                raise InputFileError(f"{path}: cannot read it as csv (Expected 2 fields in line "
                                     "4, saw 4)")
            yield number, row

    monkeypatch.setattr(inputs, "iter_dataset_rows", breaks_after_two)
    outcome = run(tiny_recipe, path, tmp_path / "out", shared_engine)
    assert outcome.status == "failed" and outcome.exit_code == EXIT_USAGE
    assert "rerun with --force-resume" in outcome.message
    assert sorted(r["id"] for r in read_jsonl(tmp_path / "out" / "outputs.jsonl")) == ["r0", "r1"]
    monkeypatch.setattr(inputs, "iter_dataset_rows", real)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(InputFileError, match="empty.csv: cannot read it as csv"):
        run(tiny_recipe, empty, tmp_path / "out2", shared_engine)
    malformed = tmp_path / "malformed.csv"            # within the reader's first chunk
    malformed.write_text("id,prompt\nr0,Hi\nbad,too,many,fields\nr1,Yo\n")
    with pytest.raises(InputFileError, match=r"malformed.csv: cannot read it as csv \(.*line 3"):
        run(tiny_recipe, malformed, tmp_path / "out3", shared_engine)
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()


def test_a_resume_in_other_numerics_is_said(tmp_path, tiny_recipe, shared_engine, caplog):
    """dtype: auto resolves by host: a run resumed on a host without native bf16 computes the
    rest in fp32. The replies stay; the log says the run now mixes two dtypes."""
    from batchinfer.runner.resume_check import numerics_changed

    lines = [{"id": f"r{i}", "prompt": f"Question {i}?"} for i in range(6)]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    run(tiny_recipe, path, tmp_path / "run", shared_engine, limit=3)
    report_path = tmp_path / "run" / "report.json"
    first = json.loads(report_path.read_text())
    run(tiny_recipe, path, tmp_path / "run", shared_engine, limit=3)   # nothing left: no engine
    report = json.loads(report_path.read_text())
    assert report["engine"] == first["engine"] and report["model"] == first["model"]   # kept
    assert numerics_changed(report["engine"], report["engine"]) is None
    report["engine"]["dtype"] = "bfloat16"          # as an AVX512-BF16 host resolved it
    report_path.write_text(json.dumps(report))
    with caplog.at_level("WARNING", logger="batchinfer"):
        second = run(tiny_recipe, path, tmp_path / "run", shared_engine)
    assert second.outputs == 6
    assert any("dtype bfloat16 -> float32" in r.getMessage() and "model.dtype" in r.getMessage()
               for r in caplog.records)


def test_the_recipe_change_warning_names_what_changed():
    from batchinfer.runner.resume_check import recipe_changes

    old = "strategy:\n  name: baseline\nparallel:\n  pp: 1\nsampling:\n  max_tokens: 8\n"
    new = "strategy:\n  name: gllm\nparallel:\n  pp: 2\nsampling:\n  max_tokens: 8\n"
    assert recipe_changes(old, new) == "strategy.name: baseline -> gllm; parallel.pp: 1 -> 2"
    assert recipe_changes(old, old.replace("  pp: 1\n", "  pp:   1\n")) == "its layout only"
    # another strategy's own keys are said by its name, not listed as null -> value
    gllm = new.replace("  name: gllm\n", "  name: gllm\n  KV_thresh: 0.05\n  MaxP: 2048\n")
    assert recipe_changes(old.replace("  name: baseline\n", "  name: baseline\n  policy: hb\n"),
                          gllm) == "strategy.name: baseline -> gllm; parallel.pp: 1 -> 2"


def test_the_recipe_kept_is_the_one_the_results_were_made_with(tmp_path, tiny_recipe,
                                                               shared_engine, caplog):
    """A session that adds no result (nothing left to run, or stopped before its first) does
    not replace recipe.resolved.yaml: a later resume's warning compares with the recipe the
    results were made with and names the strategy change first; run.json names each session's
    strategy."""
    rows = [{"id": f"r{i}", "prompt": f"Q{i}"} for i in range(4)]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "run"
    assert run(tiny_recipe, path, out, shared_engine, limit=2).outputs == 2
    made_with = (out / "recipe.resolved.yaml").read_text()
    other = {name: Recipe(**{**tiny_recipe.model_dump(), "strategy": {"name": name}})
             for name in ("tdpipe", "gllm")}
    report = json.loads((out / "report.json").read_text())
    metrics = (out / "metrics.jsonl").read_text()
    run(other["tdpipe"], path, out, shared_engine, limit=2)      # nothing left: no result added
    assert (out / "metrics.jsonl").read_text() == metrics        # no sample of an idle session
    assert (out / "recipe.resolved.yaml").read_text() == made_with
    # and the report stays the one of the session that made the results
    kept = json.loads((out / "report.json").read_text())
    assert kept["strategy"]["name"] == "baseline" and kept["session"] == report["session"]
    assert kept["previous_sessions"] == report["previous_sessions"]
    with caplog.at_level("WARNING", logger="batchinfer"):
        assert run(other["gllm"], path, out, shared_engine).outputs == 4
    warning = [r.getMessage() for r in caplog.records if "recipe differs" in r.getMessage()][-1]
    assert "(strategy.name: baseline -> gllm)" in warning
    assert (out / "recipe.resolved.yaml").read_text() == made_with
    sessions = json.loads((out / "run.json").read_text())["sessions"]
    assert [s["strategy"] for s in sessions] == ["baseline", "tdpipe", "gllm"]


def test_a_start_refused_at_engine_build_leaves_the_run_as_it_was(tmp_path, tiny_recipe,
                                                                   shared_engine):
    """A usage error while the engine is built (e.g. a KV cache the layout cannot hold) exits 2
    and leaves no run behind: a new run directory is removed again, and an existing run keeps
    its recipe.resolved.yaml and run.json as they were (no session recorded for the refusal)."""
    from batchinfer.engine.errors import ConfigError

    def refused(cfg):
        raise ConfigError("memory.kv_cache_memory: too small for one sequence")

    def start(out):
        spec = JobSpec(recipe=tiny_recipe, input_path=path, output_dir=out, progress="off",
                       engine_factory=refused)
        with pytest.raises(ConfigError, match="too small"):
            run_job(spec)

    path = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"Q{i}"} for i in range(3)])
    start(tmp_path / "new" / "run")
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    start(tmp_path / "kept")
    assert list((tmp_path / "kept").iterdir()) == []       # a directory it did not make stays
    out = tmp_path / "run"
    assert run(tiny_recipe, path, out, shared_engine, limit=2).outputs == 2
    before = {name: (out / name).read_bytes() for name in ("recipe.resolved.yaml", "run.json")}
    start(out)
    assert {name: (out / name).read_bytes() for name in before} == before
    assert run(tiny_recipe, path, out, shared_engine).outputs == 3
    assert len(json.loads((out / "run.json").read_text())["sessions"]) == 2


def test_results_without_a_run_json_are_not_taken_as_this_runs(tmp_path, tiny_recipe,
                                                                 shared_engine):
    """An outputs.jsonl that batchinfer did not write (no run.json beside it) is refused: nothing
    tells which input and model made it; --force-resume takes it (its ids are skipped)."""
    from batchinfer.runner.run_dir import RunDirError

    path = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": f"Q{i}"} for i in range(3)])
    out = tmp_path / "foreign"
    out.mkdir()
    (out / "outputs.jsonl").write_text(json.dumps({"id": "q0", "text": "from another tool"}) + "\n")
    with pytest.raises(RunDirError, match="holds results but no run.json"):
        run(tiny_recipe, path, out, shared_engine)
    forced = run(tiny_recipe, path, out, shared_engine, force_resume=True)
    assert forced.session["requests_completed"] == 2 and forced.outputs == 3


def test_a_signal_as_a_completed_run_ends_is_said_beside_the_exit_code(tmp_path, tiny_recipe,
                                                                       shared_engine,
                                                                       monkeypatch):
    """SIGTERM after the last request, while the final report is written: the run completed
    (its report says so) and exits 143 as any signalled run does; the summary's message says
    both, so a script does not read 143 as work lost."""
    import signal

    from batchinfer.runner.job import Job

    finish = Job._finish

    def signalled_while_finishing(self, status, message):
        self.signals.received = signal.SIGTERM
        finish(self, status, message)

    monkeypatch.setattr(Job, "_finish", signalled_while_finishing)
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Q"}])
    outcome = run(tiny_recipe, path, tmp_path / "run", shared_engine)
    assert outcome.status == "completed" and outcome.exit_code == 143
    assert outcome.message == "every request is done; SIGTERM came as the run ended (exit 143)"


def test_a_full_disk_is_said_once_with_what_to_do(tmp_path, tiny_recipe, shared_engine,
                                                  monkeypatch):
    """A write that fails (disk full) ends the run with exit 3 and a message that names the file
    and says what to do once (it said 'everything written before is intact; make room and rerun
    to resume; everything finished so far is on disk; rerun to resume')."""
    import errno

    from batchinfer.runner.run_dir import RunDir, RunDirWriteError

    def full(self, record):
        raise RunDirWriteError(self.path / "outputs.jsonl", OSError(errno.ENOSPC, "No space"))

    monkeypatch.setattr(RunDir, "write_output", full)
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Q"}])
    outcome = run(tiny_recipe, path, tmp_path / "run", shared_engine)
    assert outcome.status == "failed" and outcome.exit_code == 3
    assert outcome.message == (f"could not write {tmp_path / 'run' / 'outputs.jsonl'}: the disk "
                               "is full (errno 28); everything written before is intact; make "
                               "room and rerun to resume")


def test_a_history_write_that_fails_leaves_the_output_it_follows_counted(tmp_path, tiny_recipe,
                                                                          shared_engine,
                                                                          monkeypatch):
    """history.jsonl is larger than outputs.jsonl, so a file-size limit or a filling disk often
    fails its write first: the output written just before it is on disk, and the run's counts
    (summary, report.json) include it (they said one output fewer than outputs.jsonl held)."""
    import errno

    from batchinfer.runner.run_dir import HISTORY, RunDir, RunDirWriteError

    def full(self, record):
        raise RunDirWriteError(self.path / HISTORY, OSError(errno.EFBIG, "File too large"))

    monkeypatch.setattr(RunDir, "write_history", full)
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Q"}, {"prompt": "R"}])
    outcome = run(tiny_recipe, path, tmp_path / "run", shared_engine)
    written = read_jsonl(tmp_path / "run" / "outputs.jsonl")
    assert outcome.exit_code == 3 and len(written) == 1
    assert outcome.outputs == 1
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["totals"]["outputs"] == 1
    assert report["session"]["requests_completed"] == 1


def test_the_recipes_stop_ids_past_the_vocabulary_are_a_usage_error(tmp_path, tiny_recipe,
                                                                     shared_engine):
    """Every request would fail alike: the job refuses at start (exit 2 through the CLI), naming
    sampling.stop_token_ids, and leaves no run behind."""
    from batchinfer.engine.errors import ConfigError

    recipe = tiny_recipe.model_copy(update={"sampling": tiny_recipe.sampling.model_copy(
        update={"stop_token_ids": [10 ** 9]})})
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Q"}])
    spec = JobSpec(recipe=recipe, input_path=path, output_dir=tmp_path / "run", progress="off",
                   engine_factory=lambda cfg: shared_engine)
    with pytest.raises(ConfigError, match=r"sampling.stop_token_ids: \[1000000000\] out of range"):
        run_job(spec)
    assert not (tmp_path / "run").exists()


def test_bad_words_that_do_not_tokenize_are_the_lines_error_or_the_recipes(tmp_path, tiny_recipe,
                                                                          shared_engine):
    """A line's bad word with no tokens is its invalid_sampling naming the key where the line
    holds it (the job goes on); the recipe's is a usage error at start."""
    from batchinfer.engine.errors import ConfigError

    path = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "ok", "prompt": "Q", "bad_words": ["Paris"]},
        {"id": "space", "prompt": "Q", "bad_words": [" "]}])
    outcome = run(tiny_recipe, path, tmp_path / "run", shared_engine)
    assert outcome.outputs == 1
    (error,) = read_jsonl(tmp_path / "run" / "errors.jsonl")
    assert (error["id"], error["code"]) == ("space", "invalid_sampling")
    assert error["message"].startswith("bad_words: ' ' gives no token")
    batch = write_jsonl(tmp_path / "batch.jsonl", [
        {"custom_id": "oa", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Q", "bad_words": ["  "]}}])
    run(tiny_recipe, batch, tmp_path / "openai", shared_engine)
    (error,) = read_jsonl(tmp_path / "openai" / "errors.jsonl")
    assert error["error"]["message"].startswith("body.bad_words: '  ' gives no token")
    recipe = tiny_recipe.model_copy(update={"sampling": tiny_recipe.sampling.model_copy(
        update={"bad_words": ["Paris", " "]})})
    spec = JobSpec(recipe=recipe, input_path=path, output_dir=tmp_path / "recipe", progress="off",
                   engine_factory=lambda cfg: shared_engine)
    with pytest.raises(ConfigError, match=r"^sampling.bad_words: ' ' gives no token"):
        run_job(spec)


def test_the_recipes_stop_ids_are_refused_before_the_weights_load(tmp_path, tiny_recipe):
    """Against the vocabulary in the model's config: a large model's load is not spent on a job
    whose every request would fail."""
    from batchinfer.engine.errors import ConfigError

    recipe = tiny_recipe.model_copy(update={"sampling": tiny_recipe.sampling.model_copy(
        update={"stop_token_ids": [2, 10 ** 9]})})
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Q"}])

    def no_build(cfg):
        raise AssertionError("the engine was built")

    spec = JobSpec(recipe=recipe, input_path=path, output_dir=tmp_path / "run", progress="off",
                   engine_factory=no_build)
    with pytest.raises(ConfigError, match=r"sampling.stop_token_ids: \[1000000000\] out of range"):
        run_job(spec)
    assert not (tmp_path / "run").exists()



def test_a_limited_run_counts_what_the_limit_left(tmp_path, tiny_recipe, shared_engine):
    """--limit runs the first N records and says so: the report's totals count the whole input
    (remaining: what the limit left, limit: N) and its status detail and the summary say how to
    continue; a lower limit after a higher one adds up too."""
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"Q{i}"} for i in range(6)])
    out = tmp_path / "run"
    first = run(tiny_recipe, path, out, shared_engine, limit=4)
    report = json.loads((out / "report.json").read_text())
    assert first.status == "completed" and report["status"] == "completed"
    assert report["totals"]["input_records"] == 6 and report["totals"]["remaining"] == 2
    assert report["totals"]["limit"] == 4
    assert first.message == report["status_detail"] == (
        "--limit 4: 2 input record(s) not run yet; rerun with a larger --limit, or none, to "
        "continue")
    lower = run(tiny_recipe, path, out, shared_engine, limit=2)
    assert lower.outputs == 4 and json.loads((out / "report.json").read_text())["totals"][
        "remaining"] == 2
    rest = run(tiny_recipe, path, out, shared_engine)
    report = json.loads((out / "report.json").read_text())
    assert rest.outputs == 6 and report["totals"]["remaining"] == 0 and not rest.message
    assert report["status_detail"] is None and report["totals"]["limit"] is None
