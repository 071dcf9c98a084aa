"""LoRA adapters under strategy vllm: model.lora_modules -> vLLM's enable_lora / max_lora_rank /
max_loras, a LoRARequest per request; where vLLM's CPU build is installed
(BATCHINFER_VLLM_PYTHON), a job through it gives transformers + peft's tokens, as ours does."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from batchinfer.engine.errors import ConfigError
from batchinfer.runner.job import EXIT_OK, JobSpec, run_job
from batchinfer.runner.recipe import Recipe
from batchinfer.strategies.vllm.params import engine_args

VLLM_PYTHON = os.environ.get("BATCHINFER_VLLM_PYTHON", "")
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON or not Path(VLLM_PYTHON).is_file(),
                                reason="no vLLM: set BATCHINFER_VLLM_PYTHON to a Python that has "
                                       "vLLM's CPU build")


def _adapter(folder: Path, rank: int) -> Path:
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": rank,
                                                            "peft_type": "LORA"}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def test_lora_modules_map_to_vllms_lora_settings(tmp_path):
    adapters = {"a": str(_adapter(tmp_path / "a", 4)), "b": str(_adapter(tmp_path / "b", 4))}
    recipe = Recipe(model={"load_format": "dummy", "lora_modules": adapters, "max_lora_rank": 4},
                    strategy={"name": "vllm"})
    args = engine_args(recipe.engine_config(), recipe.strategy, Path("/m"), "cpu")
    # vLLM takes ranks 1, 8, 16, ...: 8 holds a rank-4 adapter; both adapters in a step, and
    # on CPU an empty slot more (params.lora_engine_args: vLLM 0.32 reads the last one for a
    # token without an adapter)
    assert (args["enable_lora"], args["max_lora_rank"], args["max_loras"]) == (True, 8, 3)
    args = engine_args(recipe.engine_config(), recipe.strategy, Path("/m"), "cuda")
    assert args["max_loras"] == 2
    recipe = Recipe(model={"load_format": "dummy", "lora_modules": adapters, "max_loras": 1},
                    strategy={"name": "vllm"})
    args = engine_args(recipe.engine_config(), recipe.strategy, Path("/m"), "cpu")
    assert (args["max_lora_rank"], args["max_loras"]) == (16, 1)
    plain = Recipe(model={"load_format": "dummy"}, strategy={"name": "vllm"})
    assert "enable_lora" not in engine_args(plain.engine_config(), plain.strategy, Path("/m"), "cpu")


def test_a_missing_adapter_directory_stops_a_vllm_job_before_it_starts(tmp_path):
    recipe = Recipe(model={"load_format": "dummy", "lora_modules": {"x": str(tmp_path / "no")}},
                    strategy={"name": "vllm"})
    with pytest.raises(ConfigError, match=r"model\.lora_modules\.x: .*no: not a directory"):
        engine_args(recipe.engine_config(), recipe.strategy, Path("/m"), "cpu")


@needs_vllm
def test_a_lora_job_through_vllm_gives_peft_tokens(tmp_path, default_model_dir):
    pytest.importorskip("peft")
    from tests.tiny_lora import MAX_NEW, PROMPTS, lora_family

    # head_dim 64: vLLM's CPU attention has no kernel for the tiny families' 16
    family = lora_family(tmp_path / "models", default_model_dir, head_dim=64)
    lines = [{"id": f"{lora}-{i}", "prompt": p, "logprobs": 0, "max_tokens": MAX_NEW,
              "temperature": 0.0, "ignore_eos": True, **({"lora": lora} if lora else {})}
             for i, p in enumerate(PROMPTS) for lora in (None, "alpha", "beta")]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    recipe = Recipe(model={"path": str(family["base"]), "dtype": "float32", "max_model_len": 64,
                           "lora_modules": {n: str(p) for n, p in family["adapters"].items()}},
                    strategy={"name": "vllm", "python": VLLM_PYTHON},
                    memory={"kv_cache_memory": "1GiB"}, report={"plots": False})
    out = tmp_path / "run"
    outcome = run_job(JobSpec(recipe=recipe, input_path=tmp_path / "in.jsonl", output_dir=out,
                              progress="off"))
    assert outcome.exit_code == EXIT_OK
    records = [json.loads(x) for x in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(records) == len(lines)
    got, want = {}, {}
    for record in records:
        lora, index = record["id"].rsplit("-", 1)
        lora = None if lora == "None" else lora
        assert record.get("lora") == lora
        got[record["id"]] = [e["token_id"] for e in record["logprobs"]]
        want[record["id"]] = family["expected"][lora][int(index)]
    assert got == want          # the base model's too, beside adapter requests in a step
