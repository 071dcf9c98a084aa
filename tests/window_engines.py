"""What the windowed-model engine tests share (test_sliding_window_engine.py: every layer
windowed; test_hybrid_window_engine.py: windowed layers beside global ones): prompts and
generations longer than their windows, and engines over the tiny models with the cache and
scheduler settings under test."""
from __future__ import annotations

import torch

from tests.greedy import greedy_tokens

BLOCK, MAX_NEW = 16, 40
SHARED = list(range(300, 350))                    # a 50-token prefix: longer than the windows
PROMPTS = [[5, 17, 42], list(range(150, 230)), SHARED + [11, 12, 13], SHARED + list(range(60, 90))]


def engine_for(make_engine, path, free=True, memory="4MiB", prefix=False, backend="auto",
               **scheduler):
    """SB unless `scheduler` says otherwise; `free`: memory.free_outside_window."""
    return make_engine(model={"path": str(path), "max_model_len": 256},
                       device={"attention_backend": backend},
                       cache={"kv_cache_memory": memory, "block_size": BLOCK,
                              "free_outside_window": free, "enable_prefix_caching": prefix},
                       scheduler=scheduler or {"policy": "sb"})


def prefix_cached_twice(make_engine, path, expected):
    """HB with chunks of 16 and prefix caching, the batch twice: both runs give `expected`, the
    second from the cached prefixes (their blocks matched although the window released some),
    and blocks were released -> the engine."""
    engine = engine_for(make_engine, path, prefix=True, policy="hb", chunk_size=16,
                        max_num_batched_tokens=48)
    first = greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW)
    again = greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW)
    assert first == expected and again == expected
    stats = engine.stats()
    assert stats["prefix_cache"]["hit_tokens"] > 0 and stats["kv_window_freed_blocks"] > 0
    return engine


def graph_decode_engine(make_engine, path):
    """HB with chunks of 16 launching steps ahead (async scheduling: the host's count runs a step
    ahead of the results, and releases go by it), whose decode steps take the CUDA graphs'
    padded forward (eager on the CPU) -> (engine, its executor)."""
    from batchinfer.engine.cuda_graphs import DecodeGraphs
    from batchinfer.engine.steps_ahead import AsyncInProcessExecutor

    engine = make_engine(model={"path": str(path), "max_model_len": 256},
                         device={"device": "cpu", "attention_backend": "torch"},
                         cache={"kv_cache_memory": "4MiB", "block_size": BLOCK},
                         scheduler={"policy": "hb", "chunk_size": 16,
                                    "max_num_batched_tokens": 48, "async_scheduling": True})
    executor = engine.replicas[0].executor
    assert isinstance(executor, AsyncInProcessExecutor)
    executor.graphs = DecodeGraphs(executor.model, executor.kv_caches, executor.block_manager,
                                   torch.device("cpu"), max_batch=8, max_seq_len_to_capture=256,
                                   capture=False)
    return engine, executor
