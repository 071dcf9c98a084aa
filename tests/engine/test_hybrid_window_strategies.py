"""KV layer groups under the strategies whose schedulers run the standard block manager (gLLM's
Token Throttling, TD-Pipe, SiPipe, SiDP): a tiny Gemma 2 (windowed and global layers
alternating, a 16-key window) at PP=2, prompts and generations far past the window, gives
transformers' greedy tokens with the windowed group releasing its blocks; SiDP (which shares
SiLU MLPs only) on a tiny Qwen3 whose upper layers are windowed. Seesaw (its CPU tier keeps the
groups' tables too): tests/strategies/test_seesaw_groups.py."""
from __future__ import annotations

import pytest

from tests.greedy import greedy_tokens
from tests.tiny_families import hf_model, saved_with_greedy
from tests.window_engines import BLOCK, MAX_NEW, PROMPTS

WINDOW = 16
STRATEGIES = {
    "gllm": {"name": "gllm", "MaxP": 48, "MinP": 8},
    "tdpipe": {"name": "tdpipe", "profile_decode_batch_sizes": [1, 8],
               "profile_prefill_tokens": [64], "profile_context_len": 16},   # a short profile
    "sipipe": {"name": "sipipe"},
}


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, default_model_dir):
    """(model directory, transformers' greedy tokens for PROMPTS)."""
    model = hf_model("gemma2", num_hidden_layers=4)
    assert model.config.sliding_window == WINDOW
    return saved_with_greedy(model, tmp_path_factory.mktemp("gemma2"), default_model_dir,
                             PROMPTS, MAX_NEW)


def strategy_config(path, spec: dict, memory: str = "4MiB", **sections):
    from batchinfer.engine.config import EngineConfig
    from batchinfer.runner.recipe import strategy_class

    params = strategy_class(spec["name"]).model_validate(spec)
    sections.setdefault("parallel", {"pp": 2})
    return EngineConfig(model={"path": str(path), "max_model_len": 256},
                        cache={"kv_cache_memory": memory, "block_size": BLOCK,
                               "enable_prefix_caching": True},
                        scheduler=params.scheduler_config(), strategy=params, **sections)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_the_strategy_runs_the_groups_and_gives_transformers_tokens(gemma2, strategy):
    from batchinfer.engine.engine import Engine

    path, expected = gemma2
    with Engine.from_config(strategy_config(path, STRATEGIES[strategy])) as engine:
        bm = engine.scheduler.block_manager
        assert bm.windows == (0, WINDOW) and engine.info["kv_groups"]["windows"] == [0, WINDOW]
        assert greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW) == expected
        assert greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW) == expected
        stats = engine.stats()
        assert stats["kv_window_freed_blocks"] > 0 and stats["prefix_cache"]["hit_tokens"] > 0
        assert bm.num_free_blocks == bm.num_blocks
        bm.check_invariants()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["gllm", "tdpipe"])
def test_kv_pressure_under_the_strategy_gives_the_same_tokens(gemma2, strategy):
    """Eight sequences in 40 blocks (a pool that holds TD-Pipe's whole-prompt step of a
    256-token request, 32 blocks), each holding up to 8 global blocks and a few windowed ones, 88
    blocks for all eight at once: under the strategy's KV arithmetic (gLLM's KV_free, TD-Pipe's
    forecast over both tables) the pool fills to its last blocks (whether a sequence is
    preempted then depends on when results return), and the tokens equal transformers'."""
    from batchinfer.engine.engine import Engine
    from tests.tiny_families import TINY

    path, expected = gemma2
    # a block is a page of 2 layers' K/V (fp32); the budget is split over the PP stages' layers
    page = 2 * 2 * TINY["num_key_value_heads"] * BLOCK * 16 * 4
    config = strategy_config(path, STRATEGIES[strategy], memory=str(20 * page))
    with Engine.from_config(config) as engine:
        sched = engine.scheduler
        bm = sched.block_manager
        assert bm.num_blocks == 40
        fewest_free = [bm.num_blocks]
        schedule = sched.schedule

        def watched():
            batches = schedule()
            fewest_free[0] = min(fewest_free[0], bm.num_free_blocks)
            return batches

        sched.schedule = watched
        assert greedy_tokens(engine, PROMPTS * 2, batched=True, max_new=MAX_NEW) == expected * 2
        assert fewest_free[0] < 8      # less than one sequence's global context
        assert engine.stats()["kv_window_freed_blocks"] > 0
        # (the windowed group's peak is not bounded here: a sequence preempted late is recomputed
        # in one whole-prompt step, which holds its context in every group until the release)


@pytest.fixture(scope="module")
def qwen3_hybrid(tmp_path_factory, default_model_dir):
    """A tiny Qwen3 whose layers from max_window_layers on have a 16-key window (its
    use_sliding_window), the others global: a hybrid model with SiLU MLPs, which SiDP's shared
    FFN computes -> (model directory, transformers' greedy tokens for PROMPTS)."""
    model = hf_model("qwen3", num_hidden_layers=4, use_sliding_window=True,
                     sliding_window=WINDOW, max_window_layers=2)
    assert model.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    return saved_with_greedy(model, tmp_path_factory.mktemp("qwen3"), default_model_dir,
                             PROMPTS, MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, parallel", [("baseline", {"pp": 1}), ("sidp", {"dp": 2})])
def test_sidp_replicas_run_the_groups(qwen3_hybrid, strategy, parallel):
    """SiDP's replicas (DP=2 sharing the FFN weights) size their KV by the groups' pages and
    give transformers' tokens with the windowed group releasing; the baseline in one process
    checks the model first."""
    from batchinfer.engine.engine import Engine

    path, expected = qwen3_hybrid
    config = strategy_config(path, {"name": strategy}, parallel=parallel)
    with Engine.from_config(config) as engine:
        for replica in engine.replicas:
            assert replica.scheduler.block_manager.windows == (0, WINDOW)
        assert greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW) == expected
        stats = engine.stats()
        assert stats["kv_window_freed_blocks"] > 0
        if strategy == "sidp":   # its report counts a replica's KV as kv_capacity_tokens does
            assert stats["sidp"]["kv_tokens_per_replica"] * 2 == stats["kv_capacity_tokens"]
        grouped = engine.scheduler.block_manager.num_blocks
    one_table = config.model_copy(update={"cache": config.cache.model_copy(
        update={"free_outside_window": False})})
    with Engine.from_config(one_table) as engine:
        # a block is a page of 2 layers (a global and a windowed one) instead of all 4
        assert grouped // 2 == engine.scheduler.block_manager.num_blocks
