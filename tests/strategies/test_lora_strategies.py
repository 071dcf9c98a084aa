"""LoRA adapters (model.lora_modules) under the strategies whose model differs from the
standard one: each runs transformers + peft's tokens or refuses at start by name.

- SiDP shares each layer's FFN between replicas (and a CaS round's owner computes other
  replicas' rows): an adapter on the MLP is refused; one on attention alone runs.
- Seesaw's workers build partitions of their own, which carry no adapters: refused before its
  layout search or any worker start (it was refused by a worker's failure, minutes in).
"""
from __future__ import annotations

import pytest

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.request import SamplingParams
from tests.tiny_lora import (MAX_NEW, PROMPTS, lora_family, make_adapter, peft_greedy,
                             run_to_completion)

pytest.importorskip("peft")

CACHE = {"kv_cache_memory": "8MiB", "block_size": 4}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def family(tmp_path_factory, default_model_dir):
    """The tiny llama's base, its all-linear adapters, and one adapter on attention alone."""
    from tests.tiny_families import hf_model

    root = tmp_path_factory.mktemp("lora_strategies")
    built = lora_family(root, default_model_dir)
    base = hf_model("llama3")
    built["attention"] = make_adapter(base, root / "attention", 8, 16, False, 5, ATTENTION)
    built["expected"]["attention"] = peft_greedy(base, built["attention"], PROMPTS)
    return built


def model_section(family, adapters: dict) -> dict:
    return {"path": str(family["base"]), "max_model_len": 64,
            "lora_modules": {n: str(p) for n, p in adapters.items()}}


def test_sidp_refuses_an_adapter_on_the_mlp_by_name(family):
    from batchinfer.engine.build import preflight
    from batchinfer.engine.model.loader import load_arch
    from batchinfer.strategies.sidp.params import SiDPParams

    config = EngineConfig(model=model_section(family, family["adapters"]), cache=CACHE,
                          parallel={"dp": 2}, strategy=SiDPParams())
    with pytest.raises(ConfigError, match=r"model\.lora_modules\.alpha: strategy sidp shares "
                                          r"each layer's FFN .* targets down_proj, gate_proj, "
                                          r"up_proj: use an adapter on attention only"):
        preflight(config, load_arch(family["base"]))


def test_sidp_runs_an_adapter_on_attention_as_peft(make_engine, family, monkeypatch):
    """DP=2 with the shared FFN: base and attention-adapter requests, peft's greedy tokens."""
    from batchinfer.engine.request import Request
    from batchinfer.strategies.sidp.params import SiDPParams

    monkeypatch.setenv("BATCHINFER_LINEAR_KERNEL", "torch")    # the shared FFN's plain GEMMs
    sidp = SiDPParams()
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    requests = [Request(f"{lora}-{i}", list(p), params, lora=lora)
                for i, p in enumerate(PROMPTS) for lora in (None, "attention")]
    with make_engine(model=model_section(family, {"attention": family["attention"]}),
                     cache=CACHE, parallel={"dp": 2}, strategy=sidp,
                     scheduler=sidp.scheduler_config()) as engine:
        done = run_to_completion(engine, requests)
    assert family["expected"]["attention"] != family["expected"][None]
    assert done == {r.request_id: family["expected"][r.lora][int(r.request_id[-1])]
                    for r in requests}


def test_seesaw_refuses_adapters_by_name_before_its_workers_start(family):
    from batchinfer.engine.build import preflight
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.model.loader import load_arch
    from batchinfer.strategies.seesaw.params import SeesawParams

    config = EngineConfig(model=model_section(family, family["adapters"]), cache=CACHE,
                          parallel={"pp": 2}, strategy=SeesawParams(decode_pp=2, decode_tp=1))
    refusal = (r"model\.lora_modules: strategy seesaw builds its own model partitions, which "
               r"apply no LoRA adapters")
    with pytest.raises(ConfigError, match=refusal):
        preflight(config, load_arch(family["base"]))        # validate, run --dry-run
    with pytest.raises(ConfigError, match=refusal):
        Engine.from_config(config)


def test_profile_leaves_out_the_strategies_that_refuse_the_adapters(family, monkeypatch):
    """`batchinfer profile` on a recipe with adapters: seesaw (no adapters at all) and sidp (an
    adapter on the MLP) are skipped with the build's refusal, never ranked as the winner."""
    from types import SimpleNamespace

    from batchinfer.engine.model.loader import load_arch
    from batchinfer.sim import search

    monkeypatch.setattr(search, "simulate", lambda config, *args: SimpleNamespace(
        output_tok_per_s={"seesaw": 3.0, "sidp": 2.0}.get(config.strategy.name, 1.0)))
    base = EngineConfig(model=model_section(family, family["adapters"]), cache=CACHE)
    cands = [search.Candidate("baseline", {"name": "baseline"}, 1, 2, 1),
             search.Candidate("seesaw", {"name": "seesaw", "decode_tp": 1, "decode_pp": 2},
                              1, 2, 1),
             search.Candidate("sidp", {"name": "sidp"}, 1, 1, 2)]
    ranked = search.run_search(base, cands, [], None, load_arch(family["base"]), 64, 4, 2)
    assert [c.label for c in ranked if c.result is not None] == ["baseline"]
    skipped = {c.label: c.skipped for c in ranked if c.result is None}
    assert "strategy seesaw builds its own model partitions" in skipped["seesaw"]
    assert "model.lora_modules.alpha: strategy sidp shares each layer's FFN" in skipped["sidp"]
    attention = EngineConfig(model=model_section(family, {"attention": family["attention"]}),
                             cache=CACHE)
    cands = [search.Candidate("sidp", {"name": "sidp"}, 1, 1, 2)]
    assert search.run_search(attention, cands, [], None, load_arch(family["base"]), 64, 4,
                             2)[0].result is not None
