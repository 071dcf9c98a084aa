"""Seesaw's CPU KV tier on CUDA (resharding/cuda_kv_copies.py): copies on their own stream through
pinned staging, ordered against the compute stream by events, and a one-GPU Seesaw engine (the
multi-process runtime on CUDA) that gives the single process's greedy tokens.

CI has no GPU, so these skip there; a lent GPU machine runs them (benchmarks/engine/cuda_check.sh).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from batchinfer.resharding.kv_store import ShardView, allocate_store
from batchinfer.resharding.prefetcher import Prefetcher

# BATCHINFER_TEST_DEVICE=cpu runs the engine test on the CPU (to try a change without a GPU)
DEVICE = os.environ.get("BATCHINFER_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="torch sees no CUDA device")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the copier is CUDA's")

LAYERS, BLOCKS, HEADS, BLOCK, DIM = 3, 24, 4, 16, 8
SLEEP_CYCLES = 200_000_000        # ~0.1 s of a busy compute stream


def _prefetcher(store, paged, view, staging_bytes):
    reports = []
    done = threading.Event()

    def notify(ids, seconds, thread):
        reports.extend(ids)
        done.set()

    prefetcher = Prefetcher(store, notify, threaded=True)
    prefetcher.attach(paged, view)
    prefetcher.copier.staging_bytes = staging_bytes
    return prefetcher, reports


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copies_round_trip_in_chunks_through_both_staging_buffers(dtype):
    """A shard (layers 2-5 of 6, heads 4-8 of 8) out to the store and back to other blocks; the
    staging buffers hold 3 blocks, so 10 blocks go in 4 chunks and both buffers take turns."""
    paged = torch.randn(LAYERS, 2, BLOCKS, HEADS, BLOCK, DIM, device="cuda").to(dtype)
    store = allocate_store(16, 6, 8, BLOCK, DIM, dtype)
    view = ShardView(layer_start=2, layer_end=5, head_start=4, head_end=8)
    block_bytes = paged[:, :, 0].numel() * paged.element_size()
    prefetcher, reports = _prefetcher(store, paged, view, 3 * block_bytes)
    source, slots, target = [3, 17, 0, 9, 22, 5, 11, 14, 1, 20], list(range(15, 5, -1)), \
        [2, 4, 6, 8, 10, 12, 13, 15, 16, 18]
    try:
        prefetcher.submit(1, "out", source, slots)
        prefetcher.drain()
        back = torch.zeros_like(paged)
        prefetcher.attach(back, view)
        prefetcher.submit(2, "in", target, slots)
        prefetcher.drain()
    finally:
        prefetcher.close()
    assert reports == [1, 2] and prefetcher.copier.chunks == 8 and prefetcher.copier.pinned
    for src, slot, dst in zip(source, slots, target):
        assert torch.equal(store[slot, 2:5, :, 4:8], paged[:, :, src].cpu())
        assert torch.equal(back[:, :, dst], paged[:, :, src])
    assert store[:, :2].abs().sum() == 0 and store[:, :, :, :4].abs().sum() == 0


@needs_cuda
def test_grouped_copies_equal_the_cpu_copies():
    """KV layer groups (Gemma 2's pattern on 6 layers, the one-stage layout, stage 3-6 of a
    PP=2 split, whose slots 1-2 it shares with stage 0): the CUDA copier moves each block's
    group's slots to the same store slots as the CPU copy, in chunks of 2 blocks, and a swap-in
    gives the same paged blocks (the slots a block's group does not use here zeroed)."""
    from batchinfer.engine.kv_groups import group_layout
    from batchinfer.resharding.kv_store import swap_in, swap_out

    groups = group_layout([16 if i % 2 == 0 else 0 for i in range(6)])
    first, end = groups.slot_range(3, 6)
    view = ShardView(first, end, 0, HEADS, group_slots=groups.copy_slots(3, 6))
    paged = torch.randn(end - first, 2, BLOCKS, HEADS, BLOCK, DIM, device="cuda")
    table_blocks, source, slots = (3, 4), [3, 17, 0, 9, 22, 5, 11], [6, 5, 4, 3, 2, 1, 0]
    on_gpu, on_cpu = (allocate_store(8, groups.store_page_layers, HEADS, BLOCK, DIM,
                                     torch.float32) for _ in range(2))
    prefetcher, reports = _prefetcher(on_gpu, paged, view,
                                      2 * paged[:, :, 0].numel() * paged.element_size())
    back = torch.zeros_like(paged)
    target = [2, 4, 6, 8, 10, 12, 13]
    try:
        prefetcher.submit(1, "out", source, slots, table_blocks)
        prefetcher.drain()
        prefetcher.attach(back, view)
        prefetcher.submit(2, "in", target, slots, table_blocks)
        prefetcher.drain()
    finally:
        prefetcher.close()
    swap_out(on_cpu, paged.cpu(), view, source, slots, table_blocks)
    expected = torch.zeros_like(back, device="cpu")
    swap_in(on_cpu, expected, view, target, slots, table_blocks)
    assert reports == [1, 2]
    assert torch.equal(on_gpu, on_cpu)
    assert torch.equal(back.cpu(), expected)


@needs_cuda
def test_without_pinned_memory_the_copies_go_through_pageable_staging(monkeypatch, caplog):
    """Pinned allocation fails: one warning, pageable staging, the same round trip."""
    real_empty = torch.empty

    def no_pinning(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("no pinned memory here")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_pinning)
    paged = torch.randn(LAYERS, 2, BLOCKS, HEADS, BLOCK, DIM, device="cuda")
    store = allocate_store(4, LAYERS, HEADS, BLOCK, DIM, torch.float32)
    prefetcher, reports = _prefetcher(store, paged, ShardView(0, LAYERS, 0, HEADS), 64 << 20)
    back = torch.zeros_like(paged)
    try:
        with caplog.at_level("WARNING", logger="batchinfer"):
            prefetcher.submit(1, "out", [5, 9], [0, 3])
            prefetcher.drain()
            prefetcher.attach(back, ShardView(0, LAYERS, 0, HEADS))
            prefetcher.submit(2, "in", [1, 2], [0, 3])
            prefetcher.drain()
    finally:
        prefetcher.close()
    assert reports == [1, 2] and not prefetcher.copier.pinned
    assert sum("pinned staging memory" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(back[:, :, 1], paged[:, :, 5]) and torch.equal(back[:, :, 2], paged[:, :, 9])


@needs_cuda
def test_a_swap_out_waits_for_the_kernels_that_wrote_the_block():
    """The compute stream is busy, then writes a block; the swap-out submitted after it must copy
    the written values (the copy stream waits on the event `submit` recorded)."""
    paged = torch.zeros(LAYERS, 2, BLOCKS, HEADS, BLOCK, DIM, device="cuda")
    store = allocate_store(4, LAYERS, HEADS, BLOCK, DIM, torch.float32)
    prefetcher, reports = _prefetcher(store, paged, ShardView(0, LAYERS, 0, HEADS), 64 << 20)
    try:
        torch.cuda._sleep(SLEEP_CYCLES)
        paged[:, :, 7] = 5.0
        prefetcher.submit(1, "out", [7], [2])
        prefetcher.drain()
    finally:
        prefetcher.close()
    assert reports == [1] and bool((store[2] == 5.0).all())


@needs_cuda
def test_a_swap_in_waits_for_the_kernels_still_reading_the_blocks():
    """A kernel issued before the swap-in reads the blocks it will overwrite (a block freed by a
    finished sequence while its last step still runs): it must see the old values."""
    paged = torch.full((LAYERS, 2, BLOCKS, HEADS, BLOCK, DIM), 3.0, device="cuda")
    store = allocate_store(4, LAYERS, HEADS, BLOCK, DIM, torch.float32)
    store[1] = 9.0
    prefetcher, reports = _prefetcher(store, paged, ShardView(0, LAYERS, 0, HEADS), 64 << 20)
    try:
        torch.cuda._sleep(SLEEP_CYCLES)
        seen = paged[:, :, 4].clone()
        prefetcher.submit(1, "in", [4], [1])
        prefetcher.drain()
        torch.cuda.synchronize()
    finally:
        prefetcher.close()
    assert reports == [1] and bool((seen == 3.0).all()) and bool((paged[:, :, 4] == 9.0).all())


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from tests.tiny_families import hf_model, save_model, tokenizer_dir

    return save_model(hf_model("llama3"), tmp_path_factory.mktemp("llama3"), tokenizer_dir())


def test_one_gpu_seesaw_with_the_cpu_tier_gives_the_single_process_tokens(tiny_llama_dir):
    """Seesaw on one GPU (c_p = c_d = the one rank, in a worker process): a device cache of 20
    blocks for 24 requests of up to ~150 tokens, so prompts wait in the CPU store and come back;
    every token equals the single process's."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import SamplingParams
    from batchinfer.strategies.seesaw.params import SeesawParams

    prompts = [list(range(10 + i, 40 + 5 * i)) for i in range(24)]
    params = [SamplingParams(max_tokens=24 + i % 16, temperature=0.0, ignore_eos=True)
              for i in range(24)]
    model = {"path": str(tiny_llama_dir), "dtype": "float32", "max_model_len": 256}
    kv_token = 2 * 2 * 2 * 16 * 4                     # layers x K/V x kv heads x head dim x fp32
    with Engine.from_config(EngineConfig(model=model, device={"device": DEVICE},
                                         cache={"kv_cache_memory": "1MiB"})) as engine:
        reference = [o.output_token_ids for o in engine.generate(prompts, params)]
    seesaw = SeesawParams(decode_tp=1, decode_pp=1, cpu_kv_cache_memory=kv_token * 4096)
    config = EngineConfig(model=model, device={"device": DEVICE},
                          cache={"kv_cache_memory": kv_token * 16 * 20},
                          parallel={"step_timeout_seconds": 120},
                          scheduler=seesaw.scheduler_config(), strategy=seesaw)
    with Engine.from_config(config) as engine:
        outs = [o.output_token_ids for o in engine.generate(prompts, params)]
        stats = engine.stats()["strategy_stats"]
    assert outs == reference
    assert stats["swapped_out_tokens"] > 0 and stats["swapped_in_tokens"] == stats["swapped_out_tokens"]
    assert stats["cpu_store_peak_tokens"] > 16 * 20
    assert set(stats["kv_copies_by_thread"]) == {Prefetcher.THREAD_NAME}
