"""LoRA adapters in a job (model.lora_modules): a line's `lora` (an OpenAI line's body.model)
picks the adapter, the records say which, report.json counts requests per adapter; an unknown
name or a wrong type is that line's error record and the job goes on. The tokens are
transformers + peft's (tests/tiny_lora.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchinfer.engine.errors import RequestError
from batchinfer.runner.io.admission import request_lora
from batchinfer.runner.io.input_records import parse_openai, parse_plain_or_chat
from batchinfer.runner.job import EXIT_OK, JobSpec, run_job
from batchinfer.runner.recipe import Recipe
from batchinfer.engine.request import SamplingParams
from tests.tiny_lora import MAX_NEW, PROMPTS, lora_family

pytest.importorskip("peft")

GREEDY = {"max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def family(tmp_path_factory, default_model_dir):
    return lora_family(tmp_path_factory.mktemp("lora_job"), default_model_dir)


@pytest.fixture(scope="module")
def recipe(family):
    return Recipe(model={"path": str(family["base"]), "max_model_len": 64,
                         "lora_modules": {n: str(p) for n, p in family["adapters"].items()}},
                  memory={"kv_cache_memory": "8MiB", "block_size": 4},
                  report={"refresh_seconds": 0.2, "plots": False})


@pytest.fixture(scope="module")
def engine(recipe):
    from batchinfer.engine.engine import Engine

    return Engine.from_config(recipe.engine_config())


def run(recipe, engine, lines: list, tmp_path: Path) -> Path:
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "run"
    spec = JobSpec(recipe=recipe, input_path=path, output_dir=out, progress="off",
                   engine_factory=lambda cfg: engine)
    assert run_job(spec).exit_code == EXIT_OK
    return out


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_lines_pick_their_adapter_and_the_records_say_which(recipe, engine, family, tmp_path):
    lines = [{"id": f"{lora}-{i}", "prompt": p, "logprobs": 0, **GREEDY,
              **({"lora": lora} if lora else {})}
             for i, p in enumerate(PROMPTS) for lora in (None, "alpha", "beta")]
    lines += [{"id": "unknown", "prompt": PROMPTS[0], "lora": "gamma"},
              {"id": "number", "prompt": PROMPTS[0], "lora": 3}]
    out = run(recipe, engine, lines, tmp_path)
    outputs = {r["id"]: r for r in read(out / "outputs.jsonl")}
    assert len(outputs) == 6
    for rid, record in outputs.items():
        lora, index = rid.rsplit("-", 1)
        lora = None if lora == "None" else lora
        assert [e["token_id"] for e in record["logprobs"]] == family["expected"][lora][int(index)]
        assert record.get("lora") == lora
    errors = {r["id"]: r for r in read(out / "errors.jsonl")}
    assert errors["unknown"]["code"] == "unknown_lora"
    assert "lora: 'gamma' is not a LoRA adapter of this job; the adapters are 'alpha', 'beta'" \
        in errors["unknown"]["message"]
    assert errors["number"]["code"] == "invalid_type" and "'lora' must be a string" in \
        errors["number"]["message"]
    report = json.loads((out / "report.json").read_text())
    assert report["session"]["requests_by_lora"] == {"alpha": 2, "beta": 2}
    assert report["engine"]["lora_modules"] == ["alpha", "beta"]
    markdown = (out / "report.md").read_text()       # the requests per adapter, base model too
    assert "## LoRA adapters (this session)" in markdown
    assert "| `alpha` | 2 |" in markdown and "| `beta` | 2 |" in markdown
    assert "| base model | 2 |" in markdown


def test_a_dataset_rows_lora_column_picks_its_adapter(recipe, engine, family, tmp_path):
    """Dataset files (here a JSON array; CSV and parquet alike): the io.lora_field column (default
    `lora`) names the row's adapter, an empty cell the base model; it was ignored, every row
    running the base model, an unknown name too."""
    rows = [{"id": "a", "prompt": PROMPTS[0], "lora": "alpha"},
            {"id": "b", "prompt": PROMPTS[0], "lora": ""},
            {"id": "c", "prompt": PROMPTS[0], "lora": None},
            {"id": "d", "prompt": PROMPTS[0], "lora": "gamma"}]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    out = tmp_path / "run"
    job_recipe = recipe.model_copy(update={"sampling": recipe.sampling.model_copy(
        update={**GREEDY, "logprobs": 0})})
    spec = JobSpec(recipe=job_recipe, input_path=path, output_dir=out, progress="off",
                   engine_factory=lambda cfg: engine)
    assert run_job(spec).exit_code == EXIT_OK
    outputs = {r["id"]: r for r in read(out / "outputs.jsonl")}
    for rid, lora in (("a", "alpha"), ("b", None), ("c", None)):
        assert outputs[rid].get("lora") == lora
        assert [e["token_id"] for e in outputs[rid]["logprobs"]] == family["expected"][lora][0]
    assert [r["code"] for r in read(out / "errors.jsonl")] == ["unknown_lora"]


def test_merged_parts_count_requests_per_adapter():
    """`batchinfer report` over Slurm parts: each part's requests per adapter summed."""
    from batchinfer.runner.report.report import merge_reports, render_markdown

    def part(by_lora, completed):
        return {"status": "completed", "totals": {"outputs": completed},
                "session": {"requests_completed": completed, "requests_by_lora": by_lora}}

    merged = merge_reports({"part-0-of-2": part({"alpha": 2}, 3),
                            "part-1-of-2": part({"alpha": 1, "a|b": 4}, 5)}, "run")
    assert merged["session"]["requests_by_lora"] == {"alpha": 3, "a|b": 4}
    markdown = render_markdown(merged)
    assert "| `alpha` | 3 |" in markdown and "| base model | 1 |" in markdown
    assert "| `a\\|b` | 4 |" in markdown       # a name's | escaped: the table keeps two columns


def test_an_openai_line_names_its_adapter_with_the_body_model(recipe, engine, family, tmp_path):
    """As vLLM's server: body.model naming an adapter runs it (the envelope's model says it);
    another model name runs the base model."""
    def line(cid, model):
        return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
                "body": {"model": model, "prompt": PROMPTS[1], **GREEDY}}

    out = run(recipe, engine, [line("b", "beta"), line("base", "gpt-4o-mini")], tmp_path / "o")
    replies = {r["custom_id"]: r["response"]["body"] for r in read(out / "outputs.jsonl")}
    assert replies["b"]["model"] == "beta" and replies["base"]["model"] == "gpt-4o-mini"
    plain = run(recipe, engine, [{"id": "b", "prompt": PROMPTS[1], "lora": "beta", "logprobs": 0,
                                  **GREEDY}, {"id": "base", "prompt": PROMPTS[1], "logprobs": 0,
                                              **GREEDY}], tmp_path / "p")
    for record in read(plain / "outputs.jsonl"):      # peft's tokens, and the same text
        lora = record.get("lora")
        assert [e["token_id"] for e in record["logprobs"]] == family["expected"][lora][1]
        assert replies[record["id"]]["choices"][0]["text"] == record["text"]
    report = json.loads((out / "report.json").read_text())
    assert report["session"]["requests_by_lora"] == {"beta": 1}


def test_request_lora_reads_the_line():
    defaults = SamplingParams()
    plain = parse_plain_or_chat({"id": "a", "prompt": "x", "lora": "alpha"}, 1, defaults)
    assert request_lora(plain, ["alpha"]) == "alpha"
    with pytest.raises(RequestError, match="the adapters are none"):
        request_lora(plain, [])
    bare = parse_plain_or_chat({"id": "a", "prompt": "x"}, 1, defaults)
    assert request_lora(bare, ["alpha"]) is None
    openai = parse_openai({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                           "body": {"model": "alpha", "prompt": "x"}}, 1, defaults)
    assert request_lora(openai, ["alpha"]) == "alpha" and request_lora(openai, []) is None
