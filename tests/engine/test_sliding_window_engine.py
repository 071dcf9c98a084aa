"""A model whose every layer has a sliding window (a tiny Phi-3, 24 keys, blocks of 16) with
prompts and generations longer than the window: the engine releases the blocks behind the window
and its greedy tokens equal transformers' and its own with freeing off, under SB, under HB with
chunks, with prefix caching over prompts that share a prefix longer than the window, and under
preemption; each sequence holds its window and its chunk, not its context."""
from __future__ import annotations

import math

import pytest

from tests.greedy import greedy_tokens
from tests.tiny_families import TINY, saved_with_greedy, tiny_model
from tests.window_engines import (BLOCK, MAX_NEW, PROMPTS, engine_for, graph_decode_engine,
                                   prefix_cached_twice)

WINDOW = 24


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, default_model_dir):
    """(model directory, transformers' greedy tokens for PROMPTS)."""
    model = tiny_model("Phi3Config", "Phi3ForCausalLM", {"sliding_window": WINDOW})
    return saved_with_greedy(model, tmp_path_factory.mktemp("phi3_window"), default_model_dir,
                             PROMPTS, MAX_NEW)


@pytest.fixture
def checked(monkeypatch):
    """Every release is followed by the block manager's invariants."""
    from batchinfer.engine.kv_cache import BlockManager

    release = BlockManager.release_outside_window

    def checked_release(self, seq_id, first_query):
        released = release(self, seq_id, first_query)
        self.check_invariants()
        return released

    monkeypatch.setattr(BlockManager, "release_outside_window", checked_release)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_the_model_releases_and_equals_transformers_and_freeing_off(make_engine, windowed, checked,
                                                                    backend):
    """The CPU kernel skips the blocks before a window; the torch path reads the released slots'
    placeholder block and masks it."""
    path, expected = windowed
    on = engine_for(make_engine, path, backend=backend)
    assert (on.info["attention_backend"], on.scheduler.block_manager.window) == (backend, WINDOW)
    assert on.info["kv_window"] == WINDOW
    assert greedy_tokens(on, PROMPTS, batched=True, max_new=MAX_NEW) == expected
    assert on.stats()["kv_window_freed_blocks"] > 0
    off = engine_for(make_engine, path, free=False, backend=backend)
    assert off.scheduler.block_manager.window == off.info["kv_window"] == 0
    assert greedy_tokens(off, PROMPTS, batched=True, max_new=MAX_NEW) == expected
    assert off.stats()["kv_window_freed_blocks"] == 0


@pytest.mark.parametrize("chunk", [16, 32])
def test_chunked_prefill_holds_the_window_and_a_chunk(make_engine, windowed, checked, chunk):
    path, expected = windowed
    engine = engine_for(make_engine, path, policy="hb", chunk_size=chunk,
                        max_num_batched_tokens=64)
    assert greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW) == expected
    bm = engine.scheduler.block_manager
    assert bm.peak_seq_blocks <= math.ceil((WINDOW + chunk - 1) / BLOCK) + 1
    longest = max(len(p) for p in PROMPTS) + MAX_NEW
    assert bm.peak_seq_blocks < math.ceil(longest / BLOCK)        # 8 blocks without freeing


def test_prefix_caching_over_a_prefix_longer_than_the_window(make_engine, windowed, checked):
    """The batch twice: the second time from the cached prefixes (released blocks the cache
    indexed stay matchable while their contents are valid)."""
    engine = prefix_cached_twice(make_engine, *windowed)
    engine.scheduler.block_manager.check_invariants()


def test_preempted_sequences_that_released_blocks_recompute_the_same_tokens(make_engine, windowed,
                                                                            checked):
    """A cache of 16 blocks for four sequences that would hold up to 8 each without freeing,
    and up to 4 with it: preemptions still happen, and the recomputed sequences' tokens equal
    transformers'."""
    path, expected = windowed
    per_block = 2 * TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * BLOCK * 16 * 4
    engine = engine_for(make_engine, path, memory=str(16 * per_block), policy="hb",
                        chunk_size=16, max_num_batched_tokens=64)
    assert engine.scheduler.block_manager.num_blocks == 16
    assert greedy_tokens(engine, PROMPTS * 2, batched=True, max_new=MAX_NEW) == expected * 2
    assert engine.stats()["num_preemptions"] > 0


def test_steps_launched_ahead_and_the_graph_decode_path(make_engine, windowed, checked):
    """Async scheduling (the host's count runs a step ahead of the results, and releases go by
    it), and the CUDA graphs' padded decode forward (eager on CPU), which gathers every slot of a
    row, placeholders included, and masks the window."""
    path, expected = windowed
    engine, executor = graph_decode_engine(make_engine, path)
    first = greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW)
    again = greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW)
    assert first == expected and again == expected
    assert executor.graphs.steps > 0 and engine.stats()["kv_window_freed_blocks"] > 0


def test_the_pipeline_runtime_releases_on_its_stages(make_engine, windowed):
    """PP=2 through the multi-process runtime (two virtual engines over one block manager, each
    stage reading its layers' KV through the same tables): transformers' tokens."""
    path, expected = windowed
    with make_engine(model={"path": str(path), "max_model_len": 256},
                     cache={"kv_cache_memory": "4MiB", "block_size": BLOCK},
                     parallel={"pp": 2},
                     scheduler={"policy": "hb", "chunk_size": 16,
                                "max_num_batched_tokens": 48}) as engine:
        assert engine.scheduler.block_manager.window == engine.info["kv_window"] == WINDOW
        assert greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW) == expected
        assert engine.stats()["kv_window_freed_blocks"] > 0


def test_mistral_masks_its_window_past_it_as_transformers_does(make_engine, tmp_path,
                                                               default_model_dir, checked):
    """Mistral 7B v0.1's window on every layer: the context runs to max_position_embeddings,
    not to the window (the cap it had), and tokens past the window equal transformers'."""
    model = tiny_model("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW})
    path, expected = saved_with_greedy(model, tmp_path / "mistral_window", default_model_dir,
                                       PROMPTS, MAX_NEW)
    engine = engine_for(make_engine, path)
    assert engine.max_model_len == 256 and engine.scheduler.block_manager.window == WINDOW
    assert greedy_tokens(engine, PROMPTS, batched=False, max_new=MAX_NEW) == expected
    assert greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW) == expected
    assert engine.stats()["kv_window_freed_blocks"] > 0
