"""Automatic prefix caching through the engine (SmolLM2, fp32, greedy): outputs equal those with
caching off, under SB, HB with small chunks, a cache small enough to evict and preempt, PP=2,
gLLM, TD-Pipe and SiDP; a fully cached prompt computes its last token; seesaw refuses it."""
from __future__ import annotations

import functools
import json
import os

import pytest

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.request import SamplingParams

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SYSTEM = ("You are a careful assistant. Answer in one short sentence, cite no sources, and "
          "never use lists. ") * 3


def _prompts(tokenizer) -> list[list[int]]:
    questions = ["What is the capital of France?", "Name a prime number above 50.",
                 "Why is the sky blue?", "What is the capital of France?",   # a duplicate
                 "How many legs does a spider have?", "Who wrote Hamlet?"]
    prompts = [tokenizer.encode(SYSTEM + q) for q in questions]
    prompts.append(tokenizer.encode("Tell me a joke about cats."))          # shares nothing
    return prompts


def _outputs(engine: Engine, prompts, rounds: int = 2) -> list[list[int]]:
    """Every prompt `rounds` times, one batch after another (the second round finds the first
    round's blocks in the cache)."""
    out = []
    for _ in range(rounds):
        out.extend(o.output_token_ids for o in engine.generate(prompts, PARAMS))
    return out


def _engine(cache_tokens: int, caching: bool, max_model_len: int = 512, **sections) -> Engine:
    return Engine.from_config(EngineConfig(
        model={"max_model_len": max_model_len},
        cache={"kv_cache_memory": cache_tokens * 46080, "enable_prefix_caching": caching},
        **sections))


@pytest.mark.parametrize("sections", [
    {"scheduler": {"policy": "sb"}},
    {"scheduler": {"policy": "hb", "max_num_batched_tokens": 64, "chunk_size": 24}},
], ids=["sb", "hb-small-chunks"])
@pytest.mark.slow
def test_outputs_equal_caching_off_and_prefixes_are_reused(sections):
    with _engine(4096, False, **sections) as plain:
        prompts = _prompts(plain.tokenizer)
        reference = _outputs(plain, prompts)
        plain_prefill = plain.stats()["computed_prefill_tokens"]
    with _engine(4096, True, **sections) as cached:
        assert _outputs(cached, prompts) == reference
        stats = cached.stats()
        bm = cached.scheduler.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks
    assert stats["prefix_cache"]["hit_tokens"] > 0
    assert stats["computed_prefill_tokens"] == plain_prefill - stats["prefix_cache"]["hit_tokens"]
    assert stats["computed_prefill_tokens"] < 0.6 * plain_prefill


def test_a_shared_prefix_is_computed_once_within_one_batch():
    """All prompts arrive together: the first computes the system prompt, the others wait for
    it a step and then read it from the cache."""
    with _engine(4096, True, scheduler={"policy": "hb", "max_num_batched_tokens": 512}) as engine:
        prompts = _prompts(engine.tokenizer)
        engine.generate(prompts, PARAMS)
        stats = engine.stats()
    common = os.path.commonprefix(prompts[:-1])        # the system prompt's tokens
    shared = len(common) // 16 * 16                    # in full blocks
    assert stats["prefix_cache"]["hit_tokens"] >= 5 * shared       # 5 of 6 sharing prompts
    assert stats["computed_prefill_tokens"] <= sum(map(len, prompts)) - 5 * shared


@pytest.mark.slow
def test_a_small_cache_evicts_and_preempts_with_the_same_outputs():
    """Room for 2-3 sequences: cached blocks are evicted for new ones, and decodes preempt."""
    sections = {"scheduler": {"policy": "hb", "max_num_batched_tokens": 96}}
    with _engine(192, False, 128, **sections) as plain:
        prompts = _prompts(plain.tokenizer)
        reference = _outputs(plain, prompts)
    with _engine(192, True, 128, **sections) as cached:
        assert _outputs(cached, prompts) == reference
        stats = cached.stats()
        cached.scheduler.block_manager.check_invariants()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache"]["hit_tokens"] > 0


def test_a_fully_cached_prompt_computes_only_its_last_token():
    with _engine(4096, True) as engine:
        bs = engine.scheduler.block_manager.block_size
        prompt = engine.tokenizer.encode(SYSTEM * 2)[:2 * bs + 1]       # 2 blocks + 1 token
        first = engine.generate([prompt], PARAMS)[0].output_token_ids
        before = engine.stats()["computed_prefill_tokens"]
        again = engine.generate([prompt], PARAMS)[0].output_token_ids
        assert engine.stats()["computed_prefill_tokens"] - before == 1
        exact = prompt[:2 * bs]                                         # exactly 2 blocks
        engine.generate([exact], PARAMS)
        before = engine.stats()["computed_prefill_tokens"]
        engine.generate([exact], PARAMS)
        assert engine.stats()["computed_prefill_tokens"] - before == bs  # the last block again
    assert again == first


@functools.cache
def _single_process_reference(scheduler: str) -> tuple[list, list]:
    """(prompts, outputs) with caching off in one process, once per scheduler (JSON) for the
    layouts below (the strategies' schedulers may share one)."""
    with _engine(4096, False, scheduler=json.loads(scheduler)) as plain:
        prompts = _prompts(plain.tokenizer)
        return prompts, _outputs(plain, prompts)


@pytest.mark.parametrize("sections", [
    {"parallel": {"pp": 2}, "scheduler": {"policy": "hb", "max_num_batched_tokens": 64}},
    {"parallel": {"pp": 2}, "strategy": {"name": "gllm", "MaxP": 48, "MinP": 8}},
    {"parallel": {"pp": 2}, "strategy": {"name": "tdpipe", "profile_decode_batch_sizes": [1, 8],
                                         "profile_prefill_tokens": [64],
                                         "profile_context_len": 16}},   # a short profile
    {"parallel": {"dp": 2}, "strategy": {"name": "sidp"}},
], ids=["pp2-hb", "pp2-gllm", "pp2-tdpipe", "dp2-sidp"])
@pytest.mark.slow
def test_pipeline_parallel_outputs_equal_caching_off(sections):
    from batchinfer.runner.recipe import strategy_class

    sections = dict(sections)
    if "strategy" in sections:
        spec = sections.pop("strategy")
        params = strategy_class(spec["name"]).model_validate(spec)
        sections.update(strategy=params, scheduler=params.scheduler_config())
    scheduler = sections.get("scheduler", {})
    if not isinstance(scheduler, dict):                 # a strategy's SchedulerConfig
        scheduler = scheduler.model_dump(mode="json")
    prompts, reference = _single_process_reference(json.dumps(scheduler, sort_keys=True))
    with _engine(4096, True, **sections) as cached:
        assert _outputs(cached, prompts) == reference
        assert cached.stats()["prefix_cache"]["hit_tokens"] > 0
        cached.scheduler.block_manager.check_invariants()


def test_seesaw_refuses_prefix_caching_with_a_clear_error():
    from batchinfer.runner.recipe import strategy_class

    params = strategy_class("seesaw").model_validate({"name": "seesaw"})
    config = EngineConfig(cache={"enable_prefix_caching": True}, parallel={"pp": 2},
                          scheduler=params.scheduler_config(), strategy=params)
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        Engine.from_config(config)
