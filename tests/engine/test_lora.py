"""LoRA adapters (model.lora_modules; engine/model/lora.py): a batch mixing the base model and
two PEFT adapters gives, request by request, transformers + peft's greedy tokens (fp32), in one
process and on worker processes at PP=2 and TP=2; prefix caching never shares a block between
two adapters; bad adapters and unknown adapter names are refused by name."""
from __future__ import annotations

import json

import pytest
import torch

from batchinfer.engine.errors import ConfigError, RequestError
from batchinfer.engine.request import Request, SamplingParams
from tests.tiny_lora import MAX_NEW, PROMPTS, lora_family, run_to_completion as run

pytest.importorskip("peft")

CACHE = {"kv_cache_memory": "8MiB", "block_size": 4}


@pytest.fixture(scope="module")
def family(tmp_path_factory, default_model_dir):
    return lora_family(tmp_path_factory.mktemp("lora"), default_model_dir)


def model_section(family, **extra) -> dict:
    return {"path": str(family["base"]), "max_model_len": 64,
            "lora_modules": {n: str(p) for n, p in family["adapters"].items()}, **extra}


def mixed_requests(adapters=(None, "alpha", "beta")) -> list[Request]:
    """Every prompt under every adapter (and the base model), interleaved in one batch."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [Request(f"{lora}-{i}", list(p), params, lora=lora)
            for i, p in enumerate(PROMPTS) for lora in adapters]


def expected_of(family, requests) -> dict:
    return {r.request_id: family["expected"][r.lora][int(r.request_id.rsplit("-", 1)[1])]
            for r in requests}


@pytest.fixture(scope="module")
def other_families(tmp_path_factory, default_model_dir):
    """family name -> lora_family of it, built on first use."""
    built = {}

    def get(name):
        if name not in built:
            built[name] = lora_family(tmp_path_factory.mktemp(name), default_model_dir, name)
        return built[name]

    return get


@pytest.mark.parametrize("name, parallel", [("qwen3", None), ("phi3", None), ("phi3", {"tp": 2})],
                         ids=["qwen3", "phi3", "phi3-tp2"])
def test_other_families_mixed_batches_equal_transformers_and_peft(make_engine, other_families,
                                                                  name, parallel):
    """Qwen3 (q/k norms after the adapted qkv, head_dim != hidden / heads) and Phi-3, whose
    adapters target its fused qkv_proj / gate_up_proj (a TP rank keeps its rows of each part)."""
    fam = other_families(name)
    engine = make_engine(model=model_section(fam), cache=CACHE,
                         **({"parallel": parallel} if parallel else {}))
    try:
        requests = mixed_requests()
        assert run(engine, requests) == expected_of(fam, requests)
        assert fam["expected"]["alpha"] != fam["expected"][None]
    finally:
        engine.close()


def test_adapters_change_the_reference_tokens(family):
    """The check below could fail: each adapter's tokens differ from the base model's."""
    expected = family["expected"]
    assert expected["alpha"] != expected[None] and expected["beta"] != expected[None]
    assert expected["alpha"] != expected["beta"]


@pytest.mark.parametrize("policy", ["sb", "hb"])
def test_a_mixed_batch_equals_transformers_and_peft(make_engine, family, policy):
    """Base, alpha and beta requests in the same steps (chunked prefill under hb)."""
    scheduler = {"policy": policy} if policy == "sb" else {"policy": "hb", "chunk_size": 8}
    engine = make_engine(model=model_section(family), cache=CACHE, scheduler=scheduler)
    requests = mixed_requests()
    assert run(engine, requests) == expected_of(family, requests)
    assert engine.info["lora_modules"] == ["alpha", "beta"]


def test_one_adapter_alone_takes_the_whole_step(make_engine, family):
    """Every token of the step under one adapter: the delta over all rows, no gather."""
    engine = make_engine(model=model_section(family), cache=CACHE)
    requests = mixed_requests(adapters=("beta",))
    assert run(engine, requests) == expected_of(family, requests)


@pytest.mark.parametrize("parallel", [{"pp": 2}, {"tp": 2}], ids=["pp2", "tp2"])
def test_workers_apply_the_adapters_of_their_layers_and_shards(make_engine, family, parallel):
    engine = make_engine(model=model_section(family), cache=CACHE, parallel=parallel)
    try:
        requests = mixed_requests()
        assert run(engine, requests) == expected_of(family, requests)
    finally:
        engine.close()


def test_prefix_caching_never_shares_blocks_between_adapters(make_engine, family):
    """The same prompt under the base model and two adapters: each gets its own reply, and the
    cache serves a prompt's blocks again only to a request of the same adapter."""
    engine = make_engine(model=model_section(family), cache={**CACHE, "enable_prefix_caching": True})
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    prompt = PROMPTS[1]                           # 12 tokens: 2 full blocks before its last
    first = [Request(f"{lora}-1", list(prompt), params, lora=lora)
             for lora in (None, "alpha", "beta")]
    assert run(engine, first) == expected_of(family, first)
    bm = engine.scheduler.block_manager
    assert engine.stats()["prefix_cache"]["hit_tokens"] == 0     # three chains, none shared
    assert bm.prefix.num_cached == 3 * 4          # prompt and replies: 18 tokens, 4 blocks each
    again = [Request(f"{lora}-1", list(prompt), params, lora=lora) for lora in ("beta", "alpha")]
    assert run(engine, again) == expected_of(family, again)
    assert engine.stats()["prefix_cache"]["hit_tokens"] == 2 * 8    # each from its own chain


def test_parallel_samples_keep_their_adapter(make_engine, family):
    engine = make_engine(model=model_section(family), cache={**CACHE, "enable_prefix_caching": True})
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, n=2, seed=3)
    engine.add_request(Request("r", list(PROMPTS[1]), params, lora="alpha"))
    results = []
    while engine.has_unfinished():
        results.extend(engine.step())
    samples = results[0].samples
    assert [s.output_token_ids for s in samples] == [family["expected"]["alpha"][1]] * 2


def test_an_unknown_adapter_name_is_a_request_error(make_engine, family):
    engine = make_engine(model=model_section(family), cache=CACHE)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(RequestError, match=r"lora: 'gamma' is not a LoRA adapter of this job; "
                                           r"the adapters are 'alpha', 'beta'") as caught:
        engine.add_request(Request("x", [5, 6], params, lora="gamma"))
    assert caught.value.code == "unknown_lora"
    engine.add_request(Request("y", [5, 6], params, lora="alpha"))     # the engine goes on
    while engine.has_unfinished():
        engine.step()


def _bad_adapter(tmp_path, family, change: dict = None, drop: str = None, rename=None):
    """A copy of adapter alpha with its config changed, a file dropped or tensors renamed."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    shutil.copytree(family["adapters"]["alpha"], folder)
    if change:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
    if drop:
        (folder / drop).unlink()
    if rename:
        tensors = load_file(folder / "adapter_model.safetensors")
        tensors = {rename(k): v for k, v in tensors.items()}
        save_file(tensors, folder / "adapter_model.safetensors")
    return folder


@pytest.mark.parametrize("case, pattern", [
    ({"drop": "adapter_model.safetensors"}, r"no weights file \(adapter_model\.safetensors, "
     r"adapter_model\.bin, adapter_model\.pt: none is there\)"),
    ({"drop": "adapter_config.json"}, r"adapter_config\.json is missing"),
    ({"change": {"r": 32}}, r"rank 32 is above model\.max_lora_rank \(16\); raise"),
    ({"change": {"use_dora": True}}, r"DoRA \(use_dora: true\) is not supported"),
    ({"change": {"bias": "all"}}, r"bias 'all' is not supported"),
    ({"rename": lambda k: ("base_model.model.lm_head." + k.rsplit(".", 2)[1] + ".weight"
                           if ".0.self_attn.q_proj." in k else k)},
     r"targets 'lm_head', which the engine cannot apply LoRA to \(embed_tokens and lm_head are "
     r"not supported\)"),
], ids=["no-weights", "no-config", "rank", "dora", "bias", "lm_head"])
def test_a_bad_adapter_directory_is_a_recipe_error_naming_it(make_engine, family, tmp_path,
                                                             case, pattern):
    folder = _bad_adapter(tmp_path, family, **case)
    with pytest.raises(ConfigError, match=rf"model\.lora_modules\.bad: {folder}.*{pattern}"):
        make_engine(model={**model_section(family), "lora_modules": {"bad": str(folder)}},
                    cache=CACHE)


def test_an_adapter_saved_as_a_torch_pickle_is_read_as_vllm_reads_it(make_engine, family,
                                                                      tmp_path):
    """adapter_model.bin (peft's save_pretrained(safe_serialization=False)) in place of the
    safetensors file: vLLM 0.32 reads it (torch.load, weights_only) and so does the engine; a
    .bin that is not a tensor dict is a recipe error naming the file."""
    import shutil

    from safetensors.torch import load_file

    folder = tmp_path / "pickled"
    shutil.copytree(family["adapters"]["beta"], folder)
    torch.save(load_file(folder / "adapter_model.safetensors"), folder / "adapter_model.bin")
    (folder / "adapter_model.safetensors").unlink()
    engine = make_engine(model={**model_section(family), "lora_modules": {"beta": str(folder)}},
                         cache=CACHE)
    requests = mixed_requests((None, "beta"))
    assert run(engine, requests) == expected_of(family, requests)
    (folder / "adapter_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(ConfigError, match=rf"model\.lora_modules\.beta: {folder}/adapter_model"
                                          r"\.bin: cannot read"):
        make_engine(model={**model_section(family), "lora_modules": {"beta": str(folder)}},
                    cache=CACHE)


def test_rank_and_alpha_patterns_scale_each_module_as_peft(make_engine, family, tmp_path,
                                                           default_model_dir):
    """peft's rank_pattern / alpha_pattern (vLLM 0.32 reads them too): each module's own rank
    and scaling, a key matching a suffix of the module's name at a "." boundary, as a regex."""
    from batchinfer.engine.model.lora_adapters import module_scaling
    from tests.tiny_families import hf_model
    from tests.tiny_lora import make_adapter, peft_greedy

    base = hf_model("llama3")
    folder = make_adapter(base, tmp_path / "patterns", 4, 8, False, 7, None,
                          rank_pattern={"q_proj": 8, r"layers\.1\.mlp\.down_proj": 2},
                          alpha_pattern={"v_proj": 32, r"layers\.0\..*": 3})
    expected = peft_greedy(base, folder, PROMPTS)
    engine = make_engine(model={**model_section(family), "lora_modules": {"alpha": str(folder)}},
                         cache=CACHE)
    requests = mixed_requests((None, "alpha"))
    got = run(engine, requests)
    assert [got[f"alpha-{i}"] for i in range(len(PROMPTS))] == expected
    assert [got[f"None-{i}"] for i in range(len(PROMPTS))] == family["expected"][None]
    cfg = {"r": 4, "lora_alpha": 8, "rank_pattern": {"q_proj": 8},
           "alpha_pattern": {"v_proj": 32, "layers\\.0\\..*": 3}}
    assert module_scaling(cfg, "model.layers.0.self_attn.q_proj") == 3 / 8    # rank 8, alpha 3
    assert module_scaling(cfg, "model.layers.1.self_attn.q_proj") == 8 / 8
    assert module_scaling(cfg, "model.layers.1.self_attn.v_proj") == 32 / 4
    assert module_scaling(cfg, "model.layers.1.self_attn.xv_proj") == 8 / 4   # no "." boundary


def test_a_missing_directory_is_named(make_engine, family, tmp_path):
    with pytest.raises(ConfigError, match=r"model\.lora_modules\.x: .*nowhere: not a directory"):
        make_engine(model={**model_section(family), "lora_modules": {"x": str(tmp_path / "nowhere")}},
                    cache=CACHE)


def test_steps_without_adapter_tokens_run_the_plain_path(make_engine, family, monkeypatch):
    """A step whose sequences use no adapter builds no groups and computes no delta: the
    adapters' add is never reached, and the base model's tokens come out."""
    from batchinfer.engine.model import lora

    calls = []
    original = lora.LoraTarget.add
    monkeypatch.setattr(lora.LoraTarget, "add",
                        lambda self, y, x: calls.append(self.state.step) or original(self, y, x))
    engine = make_engine(model=model_section(family), cache=CACHE)
    requests = mixed_requests(adapters=(None,))
    assert run(engine, requests) == expected_of(family, requests)
    assert all(step is None for step in calls)
    assert lora.lora_step([0, 0], [3, 1], torch.device("cpu")) is None
    assert lora.lora_step([], [3, 1], torch.device("cpu")) is None


def test_a_strategy_building_its_own_model_without_adapters_is_refused(family, monkeypatch):
    """A strategy's own engine build (its own partitions) that applies no adapters: refused by
    name at start, not run as the base model."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.strategies import STRATEGIES

    closed = []

    class OwnEngine:
        info: dict = {}

        def close(self):
            closed.append(True)

    params = STRATEGIES["baseline"]()
    monkeypatch.setattr(type(params), "build_engine", lambda self, config: OwnEngine())
    config = EngineConfig(model=model_section(family), cache=CACHE, strategy=params)
    with pytest.raises(ConfigError, match=r"model\.lora_modules: strategy baseline builds its own "
                                          r"model, which does not apply LoRA adapters"):
        Engine.from_config(config)
    assert closed == [True]


def test_lora_modules_take_vllms_list_forms():
    """vLLM's --lora-modules forms, "name=path" and {name, path[, base_model_name]}, read into
    the {name: path} mapping; anything else, or a name given twice, is refused naming the form."""
    from pydantic import ValidationError

    from batchinfer.engine.config import ModelConfig

    listed = ModelConfig(lora_modules=["sql=/a/sql", {"name": "chat", "path": "/a/chat",
                                                      "base_model_name": "m"}])
    assert listed.lora_modules == {"sql": "/a/sql", "chat": "/a/chat"}
    assert ModelConfig(lora_modules={"sql": "/a/sql"}).lora_modules == {"sql": "/a/sql"}
    with pytest.raises(ValidationError, match=r"'sql': a list entry is \"name=path\" or"):
        ModelConfig(lora_modules=["sql"])
    with pytest.raises(ValidationError, match=r"adapter 'sql' is named twice"):
        ModelConfig(lora_modules=["sql=/a", {"name": "sql", "path": "/b"}])
