"""Models whose windowed layers alternate with global ones (tiny Gemma 2 and Gemma 3 built from
transformers' classes, a 16-key window, blocks of 16), prompts and generations far longer than
the window: the engine runs them with KV layer groups (engine/kv_groups.py), the windowed groups
releasing the blocks behind the window while the global group keeps the context, and its greedy
tokens equal transformers' alone and batched, with chunked prefill, prefix caching, preemption,
steps launched ahead with the graphs' decode forward, and at PP=2 / TP=2; with
memory.free_outside_window false every block is kept and the tokens are the same."""
from __future__ import annotations

import math

import pytest

from tests.greedy import greedy_tokens
from tests.tiny_families import TINY, hf_model, saved_with_greedy
from tests.window_engines import (BLOCK, MAX_NEW, PROMPTS, engine_for, graph_decode_engine,
                                   prefix_cached_twice)

WINDOW = 16
# Gemma 2 with 4 layers (windowed, global, windowed, global): two groups of 2 layers, so a block
# is a page of two slots, each shared by a windowed and a global layer; Gemma 3 with two
# windowed layers before its global one: three groups of one layer (two of them windowed)
MODELS = {"gemma2": {"num_hidden_layers": 4},
          "gemma3": {"num_hidden_layers": 3,
                     "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}}
GROUPS = {"gemma2": ((0, WINDOW), 2), "gemma3": ((0, WINDOW, WINDOW), 1)}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, default_model_dir):
    """family -> (model directory, transformers' greedy tokens for PROMPTS)."""
    built = {}

    def get(family):
        if family not in built:
            model = hf_model(family, **MODELS[family])
            assert model.config.sliding_window == WINDOW
            built[family] = saved_with_greedy(model, tmp_path_factory.mktemp(family),
                                              default_model_dir, PROMPTS, MAX_NEW)
        return built[family]

    return get


@pytest.fixture
def checked(monkeypatch):
    """Every release is followed by the block manager's invariants; -> the most blocks a
    sequence held per group right after a release (between steps), over the test."""
    from batchinfer.engine.group_blocks import GroupedBlockManager

    release = GroupedBlockManager.release_outside_window
    between_steps: list[int] = []

    def checked_release(self, seq_id, first_query):
        released = release(self, seq_id, first_query)
        self.check_invariants()
        held = self.held_per_group(seq_id)
        between_steps[:] = [max(a, b) for a, b in zip(between_steps, held)] or held
        return released

    monkeypatch.setattr(GroupedBlockManager, "release_outside_window", checked_release)
    return between_steps


def held_bounds(bm, between_steps: list[int], longest: int, chunk: int = 0) -> None:
    """Between steps a windowed group holds a sequence's window and one block more, the global
    group its context; while a step computes `chunk` tokens (0: a whole prompt, SB), the window
    and the chunk."""
    context = math.ceil(longest / BLOCK)
    assert bm.peak_group_blocks[0] == between_steps[0] == context
    assert all(held <= math.ceil(WINDOW / BLOCK) + 1 for held in between_steps[1:])
    if chunk:
        bound = math.ceil((WINDOW + chunk - 1) / BLOCK) + 1
        assert all(peak <= bound < context for peak in bm.peak_group_blocks[1:])


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_greedy_equals_transformers_alone_and_batched(make_engine, hybrid, checked, family,
                                                      backend):
    path, expected = hybrid(family)
    engine = engine_for(make_engine, path, backend=backend)
    bm = engine.scheduler.block_manager
    windows, page = GROUPS[family]
    assert (bm.windows, engine.info["kv_groups"]["page_layers"]) == (windows, page)
    assert engine.info["attention_backend"] == backend and engine.info["kv_window"] == WINDOW
    assert greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW) == expected
    if backend == "native":
        assert greedy_tokens(engine, PROMPTS, batched=False, max_new=MAX_NEW) == expected
    stats = engine.stats()
    assert stats["kv_window_freed_blocks"] > 0 and stats["kv_groups"]["windows"] == list(windows)
    held_bounds(bm, checked, max(len(p) for p in PROMPTS) + MAX_NEW)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


@pytest.mark.parametrize("family", sorted(MODELS))
def test_freeing_off_keeps_every_block_and_gives_the_same_tokens(make_engine, hybrid, family):
    """memory.free_outside_window: false, the ablation: one table over every layer, as before
    layer groups."""
    from batchinfer.engine.group_blocks import GroupedBlockManager

    path, expected = hybrid(family)
    engine = engine_for(make_engine, path, free=False)
    bm = engine.scheduler.block_manager
    assert not isinstance(bm, GroupedBlockManager) and bm.window == 0 and bm.num_groups == 1
    assert "kv_groups" not in engine.info
    assert greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW) == expected
    assert engine.stats()["kv_window_freed_blocks"] == 0
    assert bm.peak_seq_blocks == math.ceil((max(len(p) for p in PROMPTS) + MAX_NEW) / BLOCK)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_chunked_prefill_with_prefix_caching(make_engine, hybrid, checked, family):
    """HB with chunks of 16 and prefix caching, the batch twice: the second run matches the
    cached prefixes (the global blocks and the windowed rows its window needs)."""
    bm = prefix_cached_twice(make_engine, *hybrid(family)).scheduler.block_manager
    held_bounds(bm, checked, max(len(p) for p in PROMPTS) + MAX_NEW, chunk=16)
    bm.check_invariants()


def test_kv_pressure_preempts_and_recomputes_the_same_tokens(make_engine, hybrid, checked):
    """Gemma 2 in 24 blocks for eight sequences, each of which holds up to 8 global blocks and
    3 windowed ones: preemptions happen and the recomputed tokens equal transformers'."""
    path, expected = hybrid("gemma2")
    page = 2 * 2 * TINY["num_key_value_heads"] * BLOCK * 16 * 4      # 2 layers' K/V, fp32
    engine = engine_for(make_engine, path, memory=str(24 * page), policy="hb", chunk_size=16,
                        max_num_batched_tokens=64)
    assert engine.scheduler.block_manager.num_blocks == 24
    assert greedy_tokens(engine, PROMPTS * 2, batched=True, max_new=MAX_NEW) == expected * 2
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_window_freed_blocks"] > 0
    assert stats["kv_capacity_tokens"] == 12 * BLOCK


@pytest.mark.parametrize("family, parallel", [("gemma2", {"pp": 2}), ("gemma3", {"tp": 2})])
def test_the_multi_process_runtime_runs_the_groups(make_engine, hybrid, family, parallel):
    """PP=2 (each stage allocates the page slots its layers use, over the controller's tables)
    and TP=2 (each rank its kv heads of every slot), chunked, with prefix caching:
    transformers' tokens."""
    path, expected = hybrid(family)
    with make_engine(model={"path": str(path), "max_model_len": 256},
                     cache={"kv_cache_memory": "4MiB", "block_size": BLOCK,
                            "enable_prefix_caching": True},
                     parallel=parallel,
                     scheduler={"policy": "hb", "chunk_size": 16,
                                "max_num_batched_tokens": 48}) as engine:
        bm = engine.scheduler.block_manager
        assert bm.windows == GROUPS[family][0] and engine.info["kv_window"] == WINDOW
        assert engine.info["kv_groups"]["windows"] == list(bm.windows)
        assert greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW) == expected
        assert greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW) == expected
        stats = engine.stats()
        assert stats["kv_window_freed_blocks"] > 0 and stats["prefix_cache"]["hit_tokens"] > 0


def test_pipeline_stages_hold_their_own_slots(make_engine, tmp_path, default_model_dir):
    """Gemma 3's 5:1 pattern on 6 layers split 3 + 3: each windowed group pairs a stage-0 layer
    with a stage-1 one in a page of 2 slots, each stage storing its slot only (kv_groups'
    stage-aware layout); the tokens equal transformers' and the windowed groups release."""
    model = hf_model("gemma3", num_hidden_layers=6,
                     layer_types=["sliding_attention"] * 5 + ["full_attention"])
    path, expected = saved_with_greedy(model, tmp_path, default_model_dir, PROMPTS, MAX_NEW)
    with make_engine(model={"path": str(path), "max_model_len": 256},
                     cache={"kv_cache_memory": "4MiB", "block_size": BLOCK},
                     parallel={"pp": 2, "pp_layers": [3, 3]},
                     scheduler={"policy": "hb", "chunk_size": 16,
                                "max_num_batched_tokens": 48}) as engine:
        groups = engine.info["kv_groups"]
        assert groups["windows"] == [0, WINDOW, WINDOW, WINDOW] and groups["page_layers"] == 2
        assert groups["layers"] == [[5], [0, 3], [1, 4], [2]]
        assert greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW) == expected
        assert engine.stats()["kv_window_freed_blocks"] > 0


def test_steps_launched_ahead_and_the_graph_decode_path(make_engine, hybrid, checked):
    """Gemma 3 under async scheduling (releases go by the host's count, a step ahead) and the
    CUDA graphs' padded decode forward (eager on CPU), each group's static tables its own."""
    path, expected = hybrid("gemma3")
    engine, executor = graph_decode_engine(make_engine, path)
    assert greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW) == expected
    assert executor.graphs.steps > 0 and engine.stats()["kv_window_freed_blocks"] > 0


def page_bytes() -> int:
    """One block of the tiny Gemma 2 (a page of 2 layers' K/V, fp32)."""
    return 2 * 2 * TINY["num_key_value_heads"] * BLOCK * 16 * 4


@pytest.mark.parametrize("scheduler, prompt_len, need", [
    # SB computes a whole prompt in one step: every group grows by it before any release,
    # 2 groups x 256 / 16
    ({"policy": "sb"}, 200, 32),
    # HB with chunks of 128: the global group's 16 blocks and the windowed group's
    # ceil((16 + 127) / 16) + 1 = 10
    ({"policy": "hb", "max_num_batched_tokens": 128}, 250, 26)])
def test_a_pool_too_small_for_one_step_is_refused_at_start(make_engine, hybrid, scheduler,
                                                           prompt_len, need):
    """A pool that holds a decoding 256-token sequence (16 + 2 blocks) but not the largest step
    the scheduler gives one: refused at start with the numbers and the settings to change (it
    used to be accepted, then SB scheduled nothing forever and HB preempted the prompt forever);
    sized by that rule, the longest prompt runs to completion alone, never preempted."""
    from batchinfer.engine.errors import ConfigError

    path, _ = hybrid("gemma2")
    with pytest.raises(ConfigError) as refused:
        engine_for(make_engine, path, memory=str(18 * page_bytes()), **scheduler)
    message = str(refused.value)
    assert "holds 18 blocks" in message and f"holds up to {need}" in message
    assert "memory.kv_cache_memory" in message and "model.max_model_len" in message
    assert "max_num_batched_tokens" in message
    with pytest.raises(ConfigError):
        engine_for(make_engine, path, memory=str((need - 1) * page_bytes()), **scheduler)
    engine = engine_for(make_engine, path, memory=str(need * page_bytes()), **scheduler)
    bm = engine.scheduler.block_manager
    assert bm.num_blocks == need
    prompt = [(7 * i) % 200 + 3 for i in range(prompt_len)]
    out = greedy_tokens(engine, [prompt], batched=True, max_new=256 - prompt_len)
    assert len(out[0]) == 256 - prompt_len and engine.stats()["num_preemptions"] == 0
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()
