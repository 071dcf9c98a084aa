"""n > 1 samples per prompt through the job (the tiny dummy-weight engine, in process): one
record per input line holding the n replies in every output form, n = 1 records as before,
counting, history, deduplication, a failed sample and a run killed with part of a request's
samples done."""
from __future__ import annotations

import json
import signal

import pytest

from batchinfer.engine.parallel_sampling import child_id
from batchinfer.engine.request import SamplingParams
from batchinfer.runner.job import EXIT_OK, JobSpec, run_job
from batchinfer.runner.recipe import Recipe

from .test_job import TINY_MODEL, read_jsonl, write_jsonl

# past one KV block, so the other samples wait for the first's prompt and start from its blocks
LONG = ("Write a short note to the team about the release: what changed, what to test, who to "
        "ask about the migration, and when the freeze starts on {}.")


@pytest.fixture(scope="module")
def recipe():
    return Recipe(model=TINY_MODEL, memory={"kv_cache_memory": "16MiB"},
                  sampling=SamplingParams(max_tokens=6, temperature=0.7, seed=1),
                  strategy={"name": "baseline", "max_num_seqs": 8},
                  io={"output_order": "input"},
                  predictor={"history": True},
                  report={"refresh_seconds": 0.2, "plots": False, "metrics_interval_seconds": 0.1})


@pytest.fixture(scope="module")
def engine(recipe):
    from batchinfer.engine.engine import Engine

    return Engine.from_config(recipe.engine_config())


def run(recipe, path, out, engine, **kw):
    return run_job(JobSpec(recipe=recipe, input_path=path, output_dir=out, progress="off",
                           engine_factory=lambda cfg: engine, **kw))


def _singles(engine, prompt: str, seeds: list[int], **params) -> list[list[int]]:
    """The replies of n = 1 requests of `prompt` seeded `seeds` (the job's sampling)."""
    ids = engine.tokenizer.encode(prompt)
    outs = engine.generate([ids] * len(seeds), [SamplingParams(temperature=0.7, seed=s, **params)
                                                for s in seeds])
    return [o.output_token_ids for o in outs]


def test_one_record_per_line_holds_its_samples(tmp_path, recipe, engine):
    """Plain and chat lines with n = 3: `outputs` holds each sample (index, text, token ids,
    finish reason) as the n = 1 requests seeded seed + index give them; completion_tokens and
    the report count every sample's tokens and each line once; a line of n = 1 is written as
    before; history.jsonl keeps one record per line, its first sample's length."""
    lines = [{"id": "plain", "prompt": LONG.format("Monday"), "n": 3, "seed": 40},
             {"id": "chat", "messages": [{"role": "user", "content": LONG.format("Friday")}],
              "n": 2, "max_tokens": 4, "stop": ["."]},
             {"id": "one", "prompt": "Hello there"}]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    outcome = run(recipe, path, tmp_path / "run", engine)
    assert outcome.exit_code == EXIT_OK and outcome.outputs == 3
    plain, chat, one = read_jsonl(tmp_path / "run" / "outputs.jsonl")
    assert list(plain) == ["id", "outputs", "prompt_tokens", "completion_tokens"]
    assert [list(o) for o in plain["outputs"]] == [["index", "text", "token_ids",
                                                     "finish_reason"]] * 3
    assert [o["index"] for o in plain["outputs"]] == [0, 1, 2]
    tokens = [o["token_ids"] for o in plain["outputs"]]
    assert tokens == _singles(engine, LONG.format("Monday"), [40, 41, 42], max_tokens=6)
    assert [o["text"] for o in plain["outputs"]] == [engine.tokenizer.decode(t) for t in tokens]
    assert plain["completion_tokens"] == sum(map(len, tokens)) == 18
    assert len(chat["outputs"]) == 2 and chat["completion_tokens"] == sum(
        len(o["token_ids"]) for o in chat["outputs"])
    assert list(one) == ["id", "text", "finish_reason", "prompt_tokens", "completion_tokens"]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["totals"]["outputs"] == 3
    assert report["session"]["requests_completed"] == 3
    assert report["totals"]["completion_tokens"] == (plain["completion_tokens"]
                                                  + chat["completion_tokens"]
                                                  + one["completion_tokens"])
    assert report["session"]["completion_tokens"] == report["totals"]["completion_tokens"]
    history = read_jsonl(tmp_path / "run" / "history.jsonl")
    assert [h["id"] for h in history] == ["plain", "chat", "one"]
    assert history[0]["output_tokens"] == len(tokens[0])


def test_openai_lines_answer_n_choices(tmp_path, recipe, engine):
    """/v1/chat/completions and /v1/completions bodies with n: choices with index 0..n-1 as
    OpenAI's API returns them, usage over every choice; n = 1 keeps its single choice."""
    def line(cid, url, **body):
        if url.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": LONG.format(cid)}]
        else:
            body["prompt"] = LONG.format(cid)
        return {"custom_id": cid, "method": "POST", "url": url, "body": {"max_tokens": 5, **body}}

    path = write_jsonl(tmp_path / "in.jsonl", [
        line("c", "/v1/chat/completions", n=3, seed=9, logprobs=True),
        line("t", "/v1/completions", n=2, seed=9),
        line("u", "/v1/chat/completions")])
    run(recipe, path, tmp_path / "run", engine)
    chat, text, single = (r["response"]["body"] for r in
                          read_jsonl(tmp_path / "run" / "outputs.jsonl"))
    assert [c["index"] for c in chat["choices"]] == [0, 1, 2]
    assert all(c["message"]["role"] == "assistant" and len(c["logprobs"]["content"]) == 5
               for c in chat["choices"])
    assert chat["usage"]["completion_tokens"] == 15
    assert chat["usage"]["total_tokens"] == chat["usage"]["prompt_tokens"] + 15
    assert [c["index"] for c in text["choices"]] == [0, 1]
    assert all(isinstance(c["text"], str) and c["finish_reason"] == "length"
               for c in text["choices"])
    assert text["usage"]["completion_tokens"] == 10
    assert [c["index"] for c in single["choices"]] == [0]


def test_the_recipes_n_and_deduplication(tmp_path, recipe, engine):
    """sampling.n in the recipe gives every line its samples; two equal seeded lines are
    computed once (dedup), two equal unseeded ones never."""
    with_n = recipe.model_copy(update={"sampling": recipe.sampling.with_overrides(n=2)})
    prompt = LONG.format("Tuesday")
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": prompt}, {"id": "b", "prompt": prompt},
        {"id": "c", "prompt": prompt, "seed": -1}, {"id": "d", "prompt": prompt, "seed": -1}])
    run(with_n, path, tmp_path / "run", engine)
    a, b, c, d = read_jsonl(tmp_path / "run" / "outputs.jsonl")
    assert len(a["outputs"]) == len(c["outputs"]) == 2
    assert a["outputs"] == b["outputs"]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["session"]["dedup"]["requests"] == 1
    assert report["session"]["dedup"]["output_tokens_saved"] == a["completion_tokens"]
    unseeded = [tuple(o["token_ids"]) for r in (c, d) for o in r["outputs"]]
    assert len(set(unseeded)) > 1


def test_a_failed_sample_makes_its_line_an_error_record(tmp_path, recipe, engine, monkeypatch):
    """One sample of a line fails (an engine error): the line's record is an error naming the
    sample, nothing of it goes to outputs.jsonl, the other lines run."""
    result = engine.outputs.result

    def failing(seq):
        out = result(seq)
        if seq.request_id == child_id("bad", 1):
            out.error = "the worker holding it died"
        return out

    monkeypatch.setattr(engine.outputs, "result", failing)
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "bad", "prompt": LONG.format("Sunday"), "n": 3},
        {"id": "good", "prompt": LONG.format("Monday"), "n": 3}])
    outcome = run(recipe, path, tmp_path / "run", engine)
    assert (outcome.outputs, outcome.errors) == (1, 1)
    (error,) = read_jsonl(tmp_path / "run" / "errors.jsonl")
    assert error["id"] == "bad" and error["code"] == "engine_error" and error["line"] == 1
    assert error["message"] == "sample 1 of 3: the worker holding it died"
    assert [r["id"] for r in read_jsonl(tmp_path / "run" / "outputs.jsonl")] == ["good"]


def test_a_run_stopped_with_part_of_a_lines_samples_done_redoes_that_line(tmp_path, recipe,
                                                                           engine, monkeypatch):
    """SIGTERM once a request's first sample has finished and its others have not: nothing of
    it is written (no partial record); the resume runs it again and every line ends up in
    outputs.jsonl exactly once, whole."""
    from batchinfer.runner.job import Job

    tick = Job._tick
    seen: list[str] = []

    def stop_mid_group(self, *args, **kwargs):
        parents = self.engine._sampling._parents.values()
        partial = [p.request.request_id for p in parents if 0 < len(p.results) < len(p.children)]
        if partial and self.signals.received is None:
            seen.extend(partial)
            self.signals.received = signal.SIGTERM
        return tick(self, *args, **kwargs)

    lines = [{"id": f"r{i}", "prompt": LONG.format(f"day {i}"), "n": 3, "ignore_eos": True,
              "max_tokens": 3 + i} for i in range(6)]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    monkeypatch.setattr(Job, "_tick", stop_mid_group)
    first = run(recipe, path, tmp_path / "run", engine)
    assert first.status == "interrupted" and first.exit_code == 143 and seen
    written = {r["id"] for r in read_jsonl(tmp_path / "run" / "outputs.jsonl")}
    assert not written & set(seen)
    monkeypatch.setattr(Job, "_tick", tick)
    second = run(recipe, path, tmp_path / "run", engine)
    assert second.status == "completed" and second.outputs == 6
    records = read_jsonl(tmp_path / "run" / "outputs.jsonl")
    assert sorted(r["id"] for r in records) == [f"r{i}" for i in range(6)]
    assert all(len(r["outputs"]) == 3 for r in records)
    assert all(len(o["token_ids"]) == 3 + int(r["id"][1:]) for r in records for o in r["outputs"])
    assert not engine.has_unfinished()
