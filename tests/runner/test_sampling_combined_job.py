"""The sampling features together through the job (the tiny dummy-weight engine, in process):
n > 1 with prompt_logprobs in the OpenAI envelopes, as vLLM 0.32's server writes them."""
from __future__ import annotations

import pytest

from batchinfer.engine.request import SamplingParams
from batchinfer.runner.job import JobSpec, run_job
from batchinfer.runner.recipe import Recipe

from .test_job import TINY_MODEL, read_jsonl, write_jsonl

PROMPT = "Write a short note to the team about the release: what changed and what to test."


@pytest.fixture(scope="module")
def recipe():
    return Recipe(model=TINY_MODEL, memory={"kv_cache_memory": "16MiB"},
                  sampling=SamplingParams(max_tokens=4, temperature=0.7),
                  strategy={"name": "baseline", "max_num_seqs": 8},
                  io={"output_order": "input"},
                  report={"refresh_seconds": 0.2, "plots": False})


@pytest.fixture(scope="module")
def engine(recipe):
    from batchinfer.engine.engine import Engine

    return Engine.from_config(recipe.engine_config())


def _run(recipe, engine, tmp_path, lines: list) -> list[dict]:
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    run_job(JobSpec(recipe=recipe, input_path=path, output_dir=tmp_path / "run", progress="off",
                    engine_factory=lambda cfg: engine))
    assert not read_jsonl(tmp_path / "run" / "errors.jsonl")
    return [r["response"]["body"] for r in read_jsonl(tmp_path / "run" / "outputs.jsonl")]


def _line(cid: str, url: str, **body) -> dict:
    if url.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def test_every_completion_choice_of_n_carries_the_prompts_scores(recipe, engine, tmp_path):
    """vLLM's /v1/completions puts the request's prompt_logprobs on each of its n choices
    (CompletionResponseChoice(prompt_logprobs=final_res.prompt_logprobs) per output); seeded
    samples had them on the first choice alone. A chat completion has them once, on the body."""
    single, seeded, greedy, chat = _run(recipe, engine, tmp_path, [
        _line("one", "/v1/completions", prompt_logprobs=2, seed=3),
        _line("seeded", "/v1/completions", n=3, prompt_logprobs=2, seed=3),
        _line("greedy", "/v1/completions", n=2, prompt_logprobs=2, temperature=0),
        _line("chat", "/v1/chat/completions", n=3, prompt_logprobs=2, seed=3)])
    scores = single["choices"][0]["prompt_logprobs"]
    assert scores[0] is None and len(scores) > 10
    assert [c.get("prompt_logprobs") for c in seeded["choices"]] == [scores] * 3
    assert [c.get("prompt_logprobs") for c in greedy["choices"]] == [scores] * 2
    assert all("prompt_logprobs" not in c for c in chat["choices"])
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 10
