"""Decode steps through engine/cuda_graphs.py: padded batches, padded block tables, the padding
block, and the eager fallback. Capture itself needs a GPU (tests/engine/test_cuda_paths.py checks
graphs against eager runs there); here the same padded forward runs eagerly (`capture=False`) on
CPU with the torch attention path, so that every step of its logic is checked against the
engine's own eager steps on the embedded SmolLM2."""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.cuda_graphs import (PADDING_OWNER, DecodeGraphs, batch_sizes_up_to,
                                           width_bucket)
from tests.greedy import greedy_tokens

MAX_NEW = 12


def test_batch_sizes_cover_the_scheduler_limit():
    assert batch_sizes_up_to(1) == [1]
    assert batch_sizes_up_to(5) == [1, 2, 4, 8]
    assert batch_sizes_up_to(100)[-2:] == [96, 104]
    assert batch_sizes_up_to(512)[-1] == 512
    assert batch_sizes_up_to(5000)[-1] == 1024          # larger batches run eagerly
    assert [width_bucket(b) for b in (1, 5, 8, 9, 16, 17, 33, 100, 512)] == [1, 5, 8, 9, 16, 18, 36,
                                                                              104, 512]
    assert all(b <= width_bucket(b) <= 1.125 * b for b in range(1, 5000))


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(model={"max_model_len": 1024},
                       device={"device": "cpu", "attention_backend": "torch"},
                       scheduler={"policy": "hb", "max_num_batched_tokens": 64, "chunk_size": 32})


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(10, 49000, (n,), generator=gen).tolist() for n in (1, 5, 40, 130, 300)]


@pytest.fixture(scope="module")
def eager_tokens(engine) -> dict:
    """The engine's own eager tokens, once for both graph tests: every prompt batched, and
    each prompt alone."""
    engine.replicas[0].executor.graphs = None
    prompts = _prompts()
    return {"batched": greedy_tokens(engine, prompts, batched=True, max_new=MAX_NEW),
            "alone": greedy_tokens(engine, prompts, batched=False, max_new=MAX_NEW)}


def _with_graphs(engine, max_seq_len_to_capture: int) -> DecodeGraphs:
    executor = engine.replicas[0].executor
    graphs = DecodeGraphs(executor.model, executor.kv_caches, executor.block_manager,
                          torch.device("cpu"), max_batch=256,
                          max_seq_len_to_capture=max_seq_len_to_capture, capture=False)
    executor.graphs = graphs
    return graphs


@pytest.mark.slow
def test_padded_decode_steps_give_the_eager_tokens(engine, eager_tokens):
    executor = engine.replicas[0].executor
    prompts = _prompts()
    eager_batched, eager_alone = eager_tokens["batched"], eager_tokens["alone"][:3]
    graphs = _with_graphs(engine, 1024)
    try:
        assert greedy_tokens(engine, prompts, batched=True, max_new=MAX_NEW) == eager_batched
        assert greedy_tokens(engine, prompts[:3], batched=False, max_new=MAX_NEW) == eager_alone
    finally:
        executor.graphs = None
    # batches of 1-5 sequences ran padded to 1, 2, 4 and 8 rows, over tables of 1 to 20 blocks
    shapes = set(graphs._graphs)
    assert {batch for batch, _ in shapes} >= {1, 8}
    assert {width for _, width in shapes} >= {1, 20}
    # decode-only steps went through graphs: the alone runs' 3 x 11 and the batched run's last ones
    assert graphs.steps >= 3 * (MAX_NEW - 1)
    manager = executor.block_manager
    padding = manager.block_table(PADDING_OWNER)
    assert len(padding) == 1 and manager.num_free_blocks == manager.num_blocks - 1
    manager.check_invariants()
    manager.free(PADDING_OWNER)


@pytest.mark.slow
def test_contexts_past_max_seq_len_to_capture_run_eagerly(engine, eager_tokens):
    executor = engine.replicas[0].executor
    prompts = _prompts()[2:]                      # 40, 130 and 300 tokens
    eager = eager_tokens["alone"][2:]
    graphs = _with_graphs(engine, 64)             # tables of at most 4 blocks
    try:
        assert greedy_tokens(engine, prompts, batched=False, max_new=MAX_NEW) == eager
    finally:
        executor.graphs = None
        executor.block_manager.free(PADDING_OWNER)
    assert all(width <= 4 for _, width in graphs._graphs)
    assert 0 < graphs.steps < len(prompts) * (MAX_NEW - 1)   # only the 40-token prompt's steps


def test_a_padded_step_writes_only_its_rows_slots_and_the_padding_block(engine):
    from batchinfer.engine.step_plan import StepPlan

    executor = engine.replicas[0].executor
    manager = executor.block_manager
    seq_lens = {"a": 20, "b": 3, "c": 17}
    for seq, n in seq_lens.items():
        manager.grow(seq, n)
    graphs = _with_graphs(engine, 1024)
    plan = StepPlan(0, [11, 12, 13], [1, 1, 1], list(seq_lens.values()),
                    [manager.block_table(s) for s in seq_lens], [0, 1, 2], list(seq_lens), [5, 1, 2])
    key_cache = executor.kv_caches[0][0]
    key_cache.normal_()
    before = key_cache.clone()
    try:
        hidden, _, rows = graphs.run(plan)
    finally:
        executor.graphs = None
        for seq in [*seq_lens, PADDING_OWNER]:
            manager.free(seq)
    assert set(graphs._graphs) == {(4, 2)} and rows.tolist() == [0, 1, 2] and hidden.shape[0] == 4
    pad = graphs._pad_block
    changed = {(int(b), int(o)) for b, o in (key_cache != before).any(dim=(1, 3)).nonzero()}
    expected = {(plan.block_tables[i][(n - 1) // 16], (n - 1) % 16) for i, n in enumerate(plan.seq_lens)}
    assert changed == expected | {(pad, 0)}
