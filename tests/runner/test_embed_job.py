"""Embedding jobs (model.task: embed) end to end in process on the shipped all-MiniLM-L6-v2 (one
engine shared): records and the OpenAI embeddings envelope, bad lines as error records, the
recipe's refusals, the report, and a stopped job resumed exactly once."""
from __future__ import annotations

import base64
import json
import signal
import struct
from pathlib import Path

import pytest

from batchinfer.runner.job import EXIT_OK, JobSpec, run_job
from batchinfer.runner.recipe import Recipe, load_recipe
from batchinfer.runner.recipe_errors import RecipeError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def recipe():
    return Recipe(model={"task": "embed"}, strategy={"name": "baseline", "max_num_seqs": 4,
                                                     "max_num_batched_tokens": 256},
                  report={"refresh_seconds": 0.2, "plots": False})


@pytest.fixture(scope="module")
def engine(recipe):
    from batchinfer.engine.embedding import build_embedding_engine

    return build_embedding_engine(recipe.engine_config())


def run(recipe, path, out, engine, **kw):
    return run_job(JobSpec(recipe=recipe, input_path=Path(path), output_dir=Path(out),
                           progress="off", engine_factory=lambda cfg: engine, **kw))


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def close(a: list[float], b: list[float], tol: float = 1e-6) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol


def test_plain_records_and_bad_lines(tmp_path, recipe, engine):
    long_text = " ".join(["word"] * 400)
    lines = [{"id": "a", "prompt": "Paris is the capital of France.", "metadata": {"k": 1}},
             {"id": "ids", "prompt": [101, 7592, 2088, 102]},
             {"id": "cut", "prompt": long_text, "truncate_prompt_tokens": 16},
             {"id": "sampled", "prompt": "x", "temperature": 0.5},
             {"id": "long", "prompt": long_text},
             {"id": "dims", "prompt": "x", "dimensions": 8},
             {"id": "chat", "messages": [{"role": "user", "content": "hi"}]},
             {"id": "empty", "prompt": ""}]
    outcome = run(recipe, write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "run", engine)
    assert (outcome.outputs, outcome.errors) == (3, 5)
    out = {r["id"]: r for r in read_jsonl(tmp_path / "run" / "outputs.jsonl")}
    hf = engine.tokenizer.hf
    assert close(out["a"]["embedding"], engine.embed(["Paris is the capital of France."])[0])
    assert out["a"]["metadata"] == {"k": 1} and set(out["a"]) == {"id", "embedding",
                                                                  "prompt_tokens", "metadata"}
    assert out["a"]["prompt_tokens"] == len(hf.encode("Paris is the capital of France."))
    assert close(out["ids"]["embedding"], engine.embed([[101, 7592, 2088, 102]])[0])
    # truncated as the tokenizer truncates (its special tokens kept), vLLM's pooling rule
    cut = hf.encode(long_text, truncation=True, max_length=16)
    assert out["cut"]["prompt_tokens"] == 16 and cut[-1] == hf.sep_token_id
    assert close(out["cut"]["embedding"], engine.embed([cut])[0])
    errors = {e["id"]: e for e in read_jsonl(tmp_path / "run" / "errors.jsonl")}
    assert errors["sampled"]["code"] == "unsupported_parameter"
    assert errors["sampled"]["message"].startswith("temperature: an embedding job")
    assert errors["long"]["code"] == "prompt_too_long"
    assert "402 tokens" in errors["long"]["message"] and "256 tokens" in errors["long"]["message"]
    assert errors["dims"]["code"] == "invalid_dimensions"
    assert errors["chat"]["code"] == "no_chat_template"     # all-MiniLM has none (as in vLLM)
    assert errors["empty"]["code"] == "empty_prompt"
    assert errors["empty"]["message"].startswith("'prompt' is empty: give text (a non-empty "
                                                 "string) or token ids")
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    session = report["session"]
    assert report["task"] == "embed" and report["engine"]["pooler"]["pooling_type"] == "MEAN"
    assert set(session["throughput"]) == {"requests_per_s", "input_tokens_per_s"}
    assert "completion_tokens" not in session and "kv" not in session
    assert session["batches"]["prompt_tokens_computed"] >= session["prompt_tokens"]
    md = (tmp_path / "run" / "report.md").read_text()
    assert "prompt tok/s" in md and "output tok/s" not in md and "decode" not in md
    # only what applies to embedding: batching, device and dtype; no generation settings
    assert "**Batching:** baseline: up to 4 inputs and 256 tokens per forward; inputs up to " \
           "256 tokens (max_model_len)" in md
    assert "**Compute:** cpu, float32" in md and "**Strategy:**" not in md
    assert "embedding time (s)" in md and "| forwards |" in md
    assert not any(w in md for w in ("policy", "prepare_ahead", "generation time",
                                     "engine_prefill"))
    assert "forwards" in session["phases_s"] and "engine_prefill" not in session["phases_s"]
    assert not (tmp_path / "run" / "history.jsonl").exists()


def test_openai_embeddings_envelope(tmp_path, recipe, engine):
    def line(cid, body, url="/v1/embeddings"):
        return {"custom_id": cid, "method": "POST", "url": url, "body": body}

    texts = ["first text", "a second, longer text"]
    lines = [line("one", {"model": "my-embedder", "input": "first text"}),
             line("many", {"input": texts, "temperature": 0.3}),        # ignored, as vLLM
             line("tokens", {"input": [[101, 2034, 102], [101, 2117, 102]]}),
             line("b64", {"input": "first text", "encoding_format": "base64"}),
             line("dims", {"input": "x", "dimensions": 8}),
             line("chat", {"input": "x"}, url="/v1/chat/completions"),
             line("nothing", {"input": []})]
    outcome = run(recipe, write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "run", engine)
    assert (outcome.outputs, outcome.errors) == (4, 3)
    out = {r["custom_id"]: r for r in read_jsonl(tmp_path / "run" / "outputs.jsonl")}
    first = engine.embed(["first text"])[0]
    body = out["one"]["response"]["body"]
    assert out["one"]["response"]["status_code"] == 200 and out["one"]["error"] is None
    assert body["object"] == "list" and body["model"] == "my-embedder"
    assert [d["object"] for d in body["data"]] == ["embedding"] and body["data"][0]["index"] == 0
    assert close(body["data"][0]["embedding"], first)
    n = len(engine.tokenizer.encode("first text"))
    # vLLM 0.32's run_batch writes UsageInfo whole (model_dump_json, checked in its CPU build)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                             "prompt_tokens_details": None, "completion_tokens_details": None}
    many = out["many"]["response"]["body"]
    assert many["model"] == engine.model_id
    assert [d["index"] for d in many["data"]] == [0, 1]
    for d, text in zip(many["data"], texts):
        assert close(d["embedding"], engine.embed([text])[0])
    assert many["usage"]["prompt_tokens"] == sum(len(engine.tokenizer.encode(t)) for t in texts)
    tokens = out["tokens"]["response"]["body"]
    assert tokens["usage"]["prompt_tokens"] == 6 and len(tokens["data"]) == 2
    raw = base64.b64decode(out["b64"]["response"]["body"]["data"][0]["embedding"])
    assert close(list(struct.unpack(f"<{len(raw) // 4}f", raw)), first, 1e-6)
    errors = {e["custom_id"]: e for e in read_jsonl(tmp_path / "run" / "errors.jsonl")}
    assert {k: e["error"]["code"] for k, e in errors.items()} == {
        "dims": "invalid_dimensions", "chat": "unsupported_url", "nothing": "empty_prompt"}
    assert all(e["response"] is None for e in errors.values())


def test_recipe_refusals(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model:\n  task: embed\n  pooler_config: {pooling_type: LAST}\n"
                    "strategy: {name: gllm}\nsampling:\n  max_tokens: 8\n"
                    "predictor: {name: mean, path: " + str(tmp_path) + "}\n")
    (tmp_path / "history.jsonl").write_text("")
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    text = str(exc.value)
    assert "line 4, strategy.name: gllm schedules generation" in text and "baseline" in text
    assert "line 6, sampling.max_tokens: an embedding job" in text
    assert "predictor.name: mean" in text
    path.write_text("model:\n  pooler_config: {pooling_type: CLS}\n")
    with pytest.raises(RecipeError, match="model.pooler_config: applies to embedding jobs"):
        load_recipe(path)
    path.write_text("model:\n  task: embed\n  pooler_config: {pooling_type: MAX}\n")
    with pytest.raises(RecipeError, match="'CLS', 'LAST' or 'MEAN'"):
        load_recipe(path)
    path.write_text("model:\n  task: embed\n  pooler_config: {pooling_type: ALL}\n")
    with pytest.raises(RecipeError, match="line 3, model.pooler_config.*pooling_type ALL is "
                                          "vLLM's token-wise pooling .*use CLS, LAST or MEAN"):
        load_recipe(path)
    assert load_recipe(REPO / "recipes" / "embed-quickstart.yaml").model.task == "embed"


def test_pooler_config_takes_vllms_seq_pooling_type_and_refuses_tok_pooling_type(tmp_path):
    """vLLM 0.32's PoolerConfig: seq_pooling_type is what pooling_type sets for CLS / LAST /
    MEAN (both at once: refused, as vLLM's __post_init__); tok_pooling_type is token-wise."""
    path = tmp_path / "r.yaml"
    path.write_text("model:\n  task: embed\n  pooler_config: {seq_pooling_type: CLS}\n")
    assert load_recipe(path).model.pooler_config.pooling_type == "CLS"
    path.write_text("model:\n  task: embed\n  pooler_config: {seq_pooling_type: CLS, "
                    "pooling_type: MEAN}\n")
    with pytest.raises(RecipeError, match="line 3, model.pooler_config.*cannot set both "
                                          "pooling_type and seq_pooling_type"):
        load_recipe(path)
    path.write_text("model:\n  task: embed\n  pooler_config: {seq_pooling_type: ALL}\n")
    with pytest.raises(RecipeError, match="seq_pooling_type must be CLS, LAST or MEAN"):
        load_recipe(path)
    path.write_text("model:\n  task: embed\n  pooler_config: {tok_pooling_type: ALL}\n")
    with pytest.raises(RecipeError, match="line 3, model.pooler_config.*tok_pooling_type is "
                                          "vLLM's token-wise pooling"):
        load_recipe(path)


def test_a_stopped_job_resumes_exactly_once(tmp_path, recipe, engine, monkeypatch):
    """SIGTERM after the second forward: what finished is on disk, the rest runs on resume, no
    id twice (the in-flight requests were never written)."""
    lines = [{"id": f"d{i}", "prompt": f"Document number {i} " + "text " * (i % 7)}
             for i in range(24)]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    step = type(engine).step
    calls = {"n": 0}

    def stepping(self):
        calls["n"] += 1
        if calls["n"] == 2:
            signal.raise_signal(signal.SIGTERM)
        return step(self)

    monkeypatch.setattr(type(engine), "step", stepping)
    first = run(recipe, path, tmp_path / "run", engine)
    monkeypatch.setattr(type(engine), "step", step)
    assert first.status == "interrupted" and 0 < first.outputs < 24
    second = run(recipe, path, tmp_path / "run", engine)
    assert second.status == "completed" and second.exit_code == EXIT_OK
    ids = [r["id"] for r in read_jsonl(tmp_path / "run" / "outputs.jsonl")]
    assert sorted(ids) == sorted(f"d{i}" for i in range(24)) and len(ids) == len(set(ids))
    assert second.session["requests_completed"] == 24 - first.outputs


def test_validate_checks_embedding_records_without_weights(tmp_path):
    from typer.testing import CliRunner

    from batchinfer.cli.main import app

    lines = [{"id": "ok", "prompt": "hello"}, {"id": "t", "prompt": "hi", "max_tokens": 3},
             {"id": "d", "prompt": "hi", "dimensions": 4},
             {"id": "long", "prompt": [101] + [2088] * 300 + [102]},
             {"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {"input": 1}}]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    result = CliRunner().invoke(app, ["validate", str(REPO / "recipes" / "embed-quickstart.yaml"),
                                      "--input", str(path), "--json"])
    assert result.exit_code == 1, result.output
    summary = json.loads(result.stdout)
    assert summary["valid"] == 1 and summary["errors_by_code"] == {
        "unsupported_parameter": 1, "invalid_dimensions": 1, "prompt_too_long": 1,
        "unknown_key": 1}


def test_validate_refuses_a_bidirectional_decoder_as_the_start_does(tmp_path):
    """A decoder whose config.json says is_causal: false: the embedding engine refuses it at
    start (it would run it causally where vLLM runs it bidirectionally); validate says so too,
    with and without --no-tokenize, and not for strategy vllm, which runs it."""
    from typer.testing import CliRunner

    from batchinfer.cli.main import app
    from tests.tiny_families import hf_model, save_model, tokenizer_dir

    model = save_model(hf_model("qwen3", seed=1), tmp_path / "qwen3", tokenizer_dir())
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": [1, 2, 3]}])
    for strategy, expected in (("baseline", 2), ("vllm", 0)):
        recipe = tmp_path / f"{strategy}.yaml"
        recipe.write_text(f"model: {{task: embed, path: {model}}}\n"
                          f"strategy: {{name: {strategy}}}\n")
        for flags in ([], ["--no-tokenize"]):
            result = CliRunner().invoke(app, ["validate", str(recipe), "--input", str(path),
                                              *flags])
            assert result.exit_code == expected, (strategy, flags, result.output)
            assert ("'qwen3' decoder sets is_causal: false" in result.output) == (expected == 2)


def test_truncation_side_and_padding_as_vllms_pooling_requests(tmp_path):
    """vLLM 0.32 (renderers/params.py): the pooling runner truncates on the right whatever
    tokenizer_config.json says (text by the tokenizer, special tokens kept); a request's
    truncation_side cuts the whole token ids on that side, special tokens like any other;
    padding max_length then pads to max_model_len."""
    import shutil

    from batchinfer.engine.config import ModelConfig
    from batchinfer.engine.embedding.model_source import (default_embed_model_dir,
                                                          embedding_source)
    from batchinfer.runner.io.embed_inputs import parse_embed_openai, parse_embed_plain
    from batchinfer.runner.io.embed_records import build_embed_request
    from batchinfer.runner.io.input_records import InputError

    folder = tmp_path / "minilm"
    shutil.copytree(default_embed_model_dir(), folder,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                              "truncation_side": "left"}))
    source = embedding_source(ModelConfig(task="embed", path=str(folder)))
    text = "one two three four five"
    full = source.tokenizer.hf.encode(text)                    # [CLS] one ... five [SEP]

    def ids(**options):
        spec = parse_embed_plain({"prompt": text, **options}, 1)
        return build_embed_request(spec, source.tokenizer, 0, source.max_model_len).inputs[0]

    assert ids(truncate_prompt_tokens=4) == full[:3] + full[-1:]      # [CLS] one two [SEP]
    assert ids(truncate_prompt_tokens=4, truncation_side="left") == full[-4:]
    assert ids(truncate_prompt_tokens=4, truncation_side="right") == full[:4]
    assert ids(truncation_side="left") == full                         # nothing to cut
    assert ids(truncate_prompt_tokens=0, truncation_side="left") == []  # vLLM's slice(0, 0)
    line = {"custom_id": "c", "method": "POST", "url": "/v1/embeddings",
            "body": {"input": [text, [5, 6, 7, 8, 9]], "truncate_prompt_tokens": 3,
                     "truncation_side": "left"}}
    request = build_embed_request(parse_embed_openai(line, 1), source.tokenizer, 0,
                                  source.max_model_len)
    assert request.inputs == [full[-3:], [7, 8, 9]]
    bad = parse_embed_plain({"prompt": text, "truncation_side": "middle"}, 1)
    assert isinstance(bad, InputError) and bad.code == "invalid_parameter"
    assert bad.message == "truncation_side must be one of left, right, not 'middle'"
    # vLLM's padding max_length: pad tokens up to max_model_len after truncation, part of the
    # prompt (pooled, counted)
    pad = source.tokenizer.hf.pad_token_id
    assert ids(padding="max_length") == full + [pad] * (source.max_model_len - len(full))
    assert ids(padding="max_length", truncate_prompt_tokens=4, truncation_side="left") == \
        full[-4:] + [pad] * (source.max_model_len - 4)
    assert ids(padding="do_not_pad") == full
    bad = parse_embed_plain({"prompt": text, "padding": "longest"}, 1)
    assert bad.message == "padding must be one of max_length, do_not_pad, not 'longest'"


def test_equal_lines_are_embedded_once_and_csv_rows_read_their_columns(tmp_path, recipe,
                                                                        engine):
    lines = [{"id": f"same-{i}", "prompt": "one and the same text"} for i in range(3)]
    lines.append({"id": "cut", "prompt": "one and the same text", "dimensions": None,
                  "truncate_prompt_tokens": 3})
    outcome = run(recipe, write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "run", engine)
    assert outcome.outputs == 4
    out = {r["id"]: r for r in read_jsonl(tmp_path / "run" / "outputs.jsonl")}
    assert out["same-0"]["embedding"] == out["same-1"]["embedding"] == out["same-2"]["embedding"]
    assert out["cut"]["prompt_tokens"] == 3 and out["cut"]["embedding"] != out["same-0"]["embedding"]
    assert outcome.session["dedup"]["requests"] == 2
    csv = tmp_path / "docs.csv"
    csv.write_text("doc_id,body,team\nx1,First document.,a\nx2,,b\nx3,Third one.,c\n")
    rows = recipe.model_copy(update={"io": recipe.io.model_copy(update={
        "prompt_field": "body", "id_field": "doc_id", "metadata_fields": ["team"]})})
    outcome = run(rows, csv, tmp_path / "csv-run", engine)
    assert (outcome.outputs, outcome.errors) == (2, 1)
    out = {r["id"]: r for r in read_jsonl(tmp_path / "csv-run" / "outputs.jsonl")}
    assert out["x3"]["metadata"] == {"team": "c"}
    assert close(out["x1"]["embedding"], engine.embed(["First document."])[0])
    assert read_jsonl(tmp_path / "csv-run" / "errors.jsonl")[0]["code"] == "empty_prompt"


def test_chat_lines_render_without_the_generation_prompt(tmp_path):
    """A decoder with a chat template: messages (a plain line's, an OpenAI body's input) are
    embedded as the template renders them with add_generation_prompt false (vLLM's embeddings
    chat request), the last token pooled."""
    from batchinfer.engine.embedding import build_embedding_engine
    from tests.tiny_families import hf_model, save_model, tokenizer_dir

    model = hf_model("qwen3", seed=5, vocab_size=49152).eval()     # the tokenizer's ids
    directory = save_model(model, tmp_path / "qwen3", tokenizer_dir())
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
    chat_recipe = Recipe(model={"task": "embed", "path": str(directory),
                                "chat_template": template}, report={"plots": False})
    engine = build_embedding_engine(chat_recipe.engine_config())
    messages = [{"role": "user", "content": "Embed this question."}]
    lines = [{"id": "chat", "messages": messages},
             {"id": "chat-open", "messages": messages, "add_generation_prompt": True}]
    run(chat_recipe, write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "run", engine)
    out = {r["id"]: r for r in read_jsonl(tmp_path / "run" / "outputs.jsonl")}
    hf = engine.tokenizer.hf
    for rid, open_turn in (("chat", False), ("chat-open", True)):
        text = hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                      add_generation_prompt=open_turn)
        ids = hf.encode(text, add_special_tokens=False)
        assert out[rid]["prompt_tokens"] == len(ids)
        assert close(out[rid]["embedding"], engine.embed([ids])[0])
    # vLLM's batched chat request: several conversations in body.input or body.messages, each
    # rendered alone with the body's chat options, one data item each, usage summed
    other = [{"role": "user", "content": "And another one."}]
    batches = [{"custom_id": "c", "method": "POST", "url": "/v1/embeddings",
                "body": {"input": messages}},
               {"custom_id": "in", "method": "POST", "url": "/v1/embeddings",
                "body": {"input": [messages, other]}},
               {"custom_id": "msgs", "method": "POST", "url": "/v1/embeddings",
                "body": {"messages": [messages, other], "add_generation_prompt": True}},
               {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                "body": {"messages": [messages, [{"content": "no role"}]]}},
               {"custom_id": "none", "method": "POST", "url": "/v1/embeddings",
                "body": {"messages": []}},
               {"custom_id": "own-template", "method": "POST", "url": "/v1/embeddings",
                "body": {"messages": messages, "chat_template": "{{ messages }}"}}]
    outcome = run(chat_recipe, write_jsonl(tmp_path / "oa.jsonl", batches), tmp_path / "oa",
                  engine)
    assert (outcome.outputs, outcome.errors) == (3, 3)
    bodies = {r["custom_id"]: r["response"]["body"]
              for r in read_jsonl(tmp_path / "oa" / "outputs.jsonl")}
    assert close(bodies["c"]["data"][0]["embedding"], out["chat"]["embedding"])
    for rid, open_turn in (("in", False), ("msgs", True)):
        texts = [hf.apply_chat_template(m, chat_template=template, tokenize=False,
                                        add_generation_prompt=open_turn)
                 for m in (messages, other)]
        ids = [hf.encode(t, add_special_tokens=False) for t in texts]
        assert [d["index"] for d in bodies[rid]["data"]] == [0, 1]
        for d, one in zip(bodies[rid]["data"], ids):
            assert close(d["embedding"], engine.embed([one])[0])
        assert bodies[rid]["usage"]["prompt_tokens"] == sum(map(len, ids))
    errors = {e["custom_id"]: e["error"] for e in read_jsonl(tmp_path / "oa" / "errors.jsonl")}
    assert errors["bad"]["code"] == "invalid_messages"
    assert "body.messages[1][0].role" in errors["bad"]["message"]
    assert errors["none"]["code"] == "invalid_messages"
    assert errors["own-template"]["code"] == "unsupported_parameter"    # as vLLM's server
    assert "--trust-request-chat-template" in errors["own-template"]["message"]


def test_truncation_below_the_special_tokens_count_still_keeps_that_many(engine):
    """truncate_prompt_tokens 1 on BERT text ([CLS] ... [SEP]): the tokenizer's own truncation
    gives up and returns every token; vLLM 0.32 then cuts the ids (RenderParams'
    _token_truncation after tokenizing): [CLS] alone."""
    from batchinfer.runner.io.embed_inputs import parse_embed_plain
    from batchinfer.runner.io.embed_records import input_token_ids

    hf = engine.tokenizer.hf
    full = hf.encode("hello world again")
    for keep, expected in ((1, full[:1]), (2, [full[0], full[-1]]), (3, [*full[:2], full[-1]])):
        spec = parse_embed_plain({"prompt": "hello world again",
                                  "truncate_prompt_tokens": keep}, 1)
        assert input_token_ids(spec, engine.tokenizer, engine.max_model_len) == [expected]


def test_add_special_tokens_on_a_conversation_adds_them_to_the_rendered_chat(engine):
    """vLLM 0.32's embeddings chat request: body.add_special_tokens (default false) encodes the
    rendered chat with the tokenizer's special tokens ([CLS] ... [SEP] on BERT); it was ignored."""
    from batchinfer.engine.tokenizer import Tokenizer
    from batchinfer.runner.io.embed_inputs import parse_embed_openai
    from batchinfer.runner.io.embed_records import input_token_ids

    hf = engine.tokenizer.hf
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer = Tokenizer(hf, "minilm", chat_template=template)
    messages = [{"role": "user", "content": "Embed this question."}]
    text = hf.apply_chat_template(messages, chat_template=template, tokenize=False)
    for special in (None, False, True):
        body = {"input": messages} | ({} if special is None else {"add_special_tokens": special})
        spec = parse_embed_openai({"custom_id": "c", "method": "POST", "url": "/v1/embeddings",
                                   "body": body}, 1)
        assert input_token_ids(spec, tokenizer, engine.max_model_len) == [
            hf.encode(text, add_special_tokens=bool(special))]


def test_no_chat_template_advice_fits_the_lines_form(engine):
    """all-MiniLM has no chat template: a plain line is told to send 'prompt', an OpenAI line
    (a conversation in body.input or body.messages) to send body.input as text or token ids."""
    from batchinfer.engine.errors import RequestError
    from batchinfer.runner.io.embed_inputs import parse_embed_openai, parse_embed_plain
    from batchinfer.runner.io.embed_records import input_token_ids

    messages = [{"role": "user", "content": "hi"}]
    specs = {"plain": parse_embed_plain({"messages": messages}, 1)}
    for key in ("input", "messages"):
        specs[key] = parse_embed_openai({"custom_id": "c", "method": "POST",
                                         "url": "/v1/embeddings", "body": {key: messages}}, 2)
    advice = {}
    for form, spec in specs.items():
        with pytest.raises(RequestError) as exc:
            input_token_ids(spec, engine.tokenizer, engine.max_model_len)
        assert exc.value.code == "no_chat_template"
        advice[form] = exc.value.message.split("; ")[1]
    assert advice["plain"] == "send 'prompt' instead of 'messages', or give one as " \
                              "model.chat_template"
    assert advice["input"] == advice["messages"] == (
        "send body.input as text or token ids instead of a conversation, or give one as "
        "model.chat_template")


def test_embedding_totals_carry_no_completion_tokens_in_runs_rerenders_and_merged_shards(
        tmp_path, recipe, engine):
    """An embedding has no completion tokens: report.json totals left out a 0 the job wrote,
    `batchinfer report` recounted and the Slurm merge summed; the merged report of embedding
    parts is an embedding report (it rendered as a generation's, output tok/s and all)."""
    from batchinfer.runner.io.inputs import Shard
    from batchinfer.runner.report.report_files import rerender

    path = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"text {i}"}
                                                for i in range(4)])
    for index in range(2):
        run(recipe, path, tmp_path / "run", engine, shard=Shard(index, 2))
    part = tmp_path / "run" / "part-00000-of-00002"

    def totals(where):
        return json.loads((where / "report.json").read_text())["totals"]

    assert "completion_tokens" not in totals(part) and totals(part)["outputs"] == 2
    rerender(part)
    assert "completion_tokens" not in totals(part)
    markdown = rerender(tmp_path / "run")
    merged = json.loads((tmp_path / "run" / "report.json").read_text())
    assert merged["task"] == "embed" and merged["totals"]["outputs"] == 4
    assert "completion_tokens" not in merged["totals"]
    assert "completion_tokens" not in merged["session"]
    assert set(merged["session"]["throughput"]) == {"requests_per_s", "input_tokens_per_s"}
    assert "(embeddings)" in markdown and "## Parts" in markdown
    assert "output tok/s" not in markdown
    (part / "report.json").unlink()     # rebuilt from the run's files: still an embedding run's
    assert "(embeddings)" in rerender(part)
    rebuilt = json.loads((part / "report.json").read_text())
    assert rebuilt["task"] == "embed" and "completion_tokens" not in rebuilt["totals"]


def test_base64_embed_dtype_and_endianness_as_vllm_writes_them(tmp_path, recipe, engine):
    """vLLM's body.embed_dtype / endianness shape the base64 bytes (tensor2binary); they were
    ignored (float32 written where float16 was asked); a value vLLM refuses is the line's error."""
    import numpy as np

    def line(cid, **body):
        return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings",
                "body": {"input": "first text", "encoding_format": "base64", **body}}

    lines = [line("f16", embed_dtype="float16"), line("f16-big", embed_dtype="float16",
                                                      endianness="big"),
             line("bf16", embed_dtype="bfloat16", endianness="little"),
             line("f32-big", endianness="big"), line("bad", embed_dtype="int8")]
    outcome = run(recipe, write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "run", engine)
    assert (outcome.outputs, outcome.errors) == (4, 1)
    out = {r["custom_id"]: base64.b64decode(r["response"]["body"]["data"][0]["embedding"])
           for r in read_jsonl(tmp_path / "run" / "outputs.jsonl")}
    first = np.array(engine.embed(["first text"])[0], dtype=np.float32)
    assert np.array_equal(np.frombuffer(out["f16"], "<f2"), first.astype(np.float16))
    assert np.array_equal(np.frombuffer(out["f16-big"], ">f2"), first.astype(np.float16))
    assert np.array_equal(np.frombuffer(out["f32-big"], ">f4"), first)
    bf16 = (np.frombuffer(out["bf16"], "<u2").astype(np.uint32) << 16).view(np.float32)
    assert len(bf16) == len(first) and np.allclose(bf16, first, rtol=2**-8, atol=0)
    error = read_jsonl(tmp_path / "run" / "errors.jsonl")[0]
    assert error["error"]["code"] == "invalid_parameter"
    assert "body.embed_dtype must be one of float32, float16, bfloat16" in error["error"]["message"]
