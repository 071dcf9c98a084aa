"""SiPipe's sampler pool (strategies/sipipe/sampler_pool.py): the pool's layout, how a micro-batch's
rows are split across samplers, the same tokens whichever split (in process, each share read in
place from the micro-batch's logits slot), the slot hand-over guard and the recipe keys."""
from __future__ import annotations

import random

import pytest
import torch

from batchinfer.engine.kernels import load_native_kernels
from batchinfer.engine.sampler import Sampler
from batchinfer.runner.recipe import parse_recipe
from batchinfer.runner.recipe_errors import RecipeError
from batchinfer.strategies.sipipe.column_sampler import ColumnSampler
from batchinfer.strategies.sipipe.columns import ColumnJoin
from batchinfer.strategies.sipipe.logits_channel import (LogitsProducer, SamplerLink,
                                                         allocate_slots)
from batchinfer.strategies.sipipe.sampler_pool import PoolLayout, ShareAssigner
from tests.sipipe_churn import churn
from tests.strategies.test_sipipe import PARAMS, _scratch


def _join_stub(rid, col):
    return ColumnJoin(col, rid, [], [], None, 0)


def test_pool_layouts_with_and_without_the_split():
    split = PoolLayout.of(depth=2, max_num_seqs=256, split=True, samplers=3)
    assert (split.samplers, split.replicas, split.capacity, split.slot_columns) == (3, 2, 86, 258)
    assert split.shares_of(5) == [(0, 1), (1, 1), (2, 1)]
    assert sorted(split.target(s, r) for s in range(3) for r in range(2)) == list(range(6))
    whole = PoolLayout.of(depth=2, max_num_seqs=256, split=False, samplers=7)
    assert (whole.samplers, whole.replicas, whole.capacity, whole.slot_columns) == (2, 1, 256, 256)
    assert [whole.shares_of(n) for n in range(3)] == [[(0, 0)], [(1, 0)], [(0, 0)]]


def test_rows_are_split_evenly_sticky_and_rebalanced_by_the_highest_column():
    a = ShareAssigner(shares=2, capacity=3)
    cols, ups = a.assign(list("abcde"), [0] * 5, _join_stub)   # new rows: fewest first, then 0
    assert cols == [0, 3, 1, 4, 2] and [u.width for u in ups] == [3, 2]
    assert [[j.request_id for j in u.joins] for u in ups] == [["a", "c", "e"], ["b", "d"]]
    cols, ups = a.assign(list("bdf"), [1, 1, 0], _join_stub)   # share 0 emptied; f fills it
    assert cols == [1, 2, 0] and [u.width for u in ups] == [1, 2] and a.handed_over == 0
    assert [[j.request_id for j in u.joins] for u in ups] == [["f"], []]
    cols, ups = a.assign(list("bdfgh"), [2, 2, 1, 0, 0], _join_stub)
    assert [u.width for u in ups] == [3, 2]                     # g, h to share 0 (ties: lowest)
    cols, ups = a.assign(list("bd"), [3, 3], _join_stub)       # 0 vs 2 columns: d moves over
    assert a.handed_over == 1 and [u.width for u in ups] == [1, 1]
    assert [[(j.request_id, j.column) for j in u.joins] for u in ups] == [[("d", 0)], []]
    assert not ups[1].moves and cols == [1, 0]                  # d was share 1's last column
    with pytest.raises(ValueError, match="sampler pool's 2 x 3 columns"):
        a.assign(list("uvwxyz") + ["t"], [0] * 7, _join_stub)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("split,samplers", [(False, 2), (True, 1), (True, 2), (True, 3)])
def test_a_seeded_request_samples_the_same_tokens_whichever_split(native, split, samplers):
    """PP=2 over 60 micro-batches with sequences joining, leaving, moving between residues and
    having their output trimmed: every sampler of the pool samples its share straight from the
    micro-batch's [V, B] slot (a strided view when split), and the tokens equal one full-width
    column sampler's (and, native, the default row sampler's); each column's buffers equal a
    from-scratch computation; split shares differ by at most one column."""
    if native and not load_native_kernels():
        pytest.skip("native kernels did not build")
    vocab, rng, depth = 1003, random.Random(3), 2
    gen = torch.Generator().manual_seed(3)
    pool = PoolLayout.of(depth, 9, split, samplers)
    states = {(s, r): ColumnSampler(vocab, pool.capacity, 256, (2,), native)
              for s in range(pool.samplers) for r in range(pool.replicas)}
    assigners = [ShareAssigner(len(pool.shares_of(r)), pool.capacity) for r in range(depth)]
    whole = [ShareAssigner(1, 9) for _ in range(depth)]
    reference = [ColumnSampler(vocab, 9, 256, (2,), native) for _ in range(depth)]
    default = Sampler(vocab, (2,), torch.device("cpu"), native_kernels=native)
    strided = 0
    for step, r, batch, rows, seqs in churn(vocab, rng, PARAMS):
        lens = [len(s.output_token_ids) for s in rows]
        logits = torch.randn(len(rows), vocab, generator=gen) * 3

        def join_of(rid, col):
            s = seqs[rid]
            return ColumnJoin(col, rid, s.request.prompt_token_ids, list(s.output_token_ids),
                              s.request.sampling, s.request.sampling.seed,
                              s.request.bad_words_token_ids)

        ref_cols, (ref_update,) = whole[r].assign(batch, lens, join_of)
        reference[r].apply(ref_update)
        ref_slot = torch.empty(vocab, len(rows))
        ref_slot[:, ref_cols] = logits.t()
        ref_tokens, _ = reference[r].sample(ref_slot)
        expected = [ref_tokens[c] for c in ref_cols]
        if native:
            default_tokens, _ = default.sample(logits.clone(), default.prepare(rows))
            assert expected == default_tokens.tolist(), f"step {step}"

        cols, updates = assigners[r].assign(batch, lens, join_of)
        slot = torch.empty(vocab, len(rows))                # the micro-batch's logits slot
        slot[:, cols] = logits.t()
        tokens, offset, where = [], 0, {}
        for (sampler, replica), update in zip(pool.shares_of(step), updates):
            state = states[(sampler, replica)]
            state.apply(update)
            if update.width:
                share = slot[:, offset:offset + update.width]
                strided += not share.is_contiguous()
                tokens += state.sample(share)[0]
            for col in range(update.width):
                where[offset + col] = (state, col)
            offset += update.width
        widths = [u.width for u in updates]
        assert max(widths) - min(widths) <= 1 and sum(widths) == len(rows)
        assert [tokens[c] for c in cols] == expected, f"step {step}"
        for seq, token in zip(rows, expected):
            seq.output_token_ids.append(token)
        for seq, c in zip(rows, cols):
            state, col = where[c]
            seen, counts, present = _scratch(seq, vocab)
            n = len(seq.output_token_ids)
            assert torch.equal(state.seen[:, col], seen)
            assert torch.equal(state.counts[:, col], counts)
            assert torch.equal(state.present[:, col], present)
            assert state.outputs[:n, col].tolist() == seq.output_token_ids
    assert (strided > 0) == (split and samplers > 1)


class _Conn:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


def _plan(mb_id: int):
    from batchinfer.strategies.sipipe.executor import ColumnPlan

    return ColumnPlan(mb_id, [], [], [], [], [], [], [], sample_columns=[])


def test_the_last_stage_tells_every_sampler_and_waits_for_the_slot_to_be_released():
    pool = PoolLayout.of(depth=2, max_num_seqs=4, split=True, samplers=2)
    slots, consumed = allocate_slots(pool, 8, pool.slot_columns)
    conns = [_Conn(), _Conn()]
    producer = LogitsProducer(SamplerLink(pool, slots, consumed, conns), 8, tp_rank=0)
    for mb in (0, 1):
        producer.publish(None, _plan(mb), None, None, torch.empty(0, dtype=torch.long), 0.1)
    assert [[m[1] for m in c.sent] for c in conns] == [[0, 1], [0, 1]]
    consumed[pool.target(0, 0)] = 0                  # sampler 1 still reads micro-batch 0's slot
    with pytest.raises(RuntimeError, match="sampler 1 has not released logits slot 0"):
        producer.publish(None, _plan(2), None, None, torch.empty(0, dtype=torch.long), 0.1)
    consumed[pool.target(1, 0)] = 0
    producer.publish(None, _plan(2), None, None, torch.empty(0, dtype=torch.long), 0.1)
    assert [m[1] for m in conns[1].sent] == [0, 1, 2]


def _share(mb_id: int, offset: int, tokens: list[int], sample_s: float) -> dict:
    return {"mb_id": mb_id, "offset": offset, "tokens": tokens, "logprobs": [None] * len(tokens),
            "forward_s": 0.5, "sample_s": sample_s}


def test_a_micro_batch_is_done_when_every_share_is_back_whatever_the_order():
    """Three samplers' shares of micro-batch 5 arrive out of order, with micro-batch 6's between:
    not ready until the last; then each row's token from its column, the pool's slowest share
    as the sampling time, and micro-batch 6's share left queued."""
    from collections import defaultdict, deque
    from types import SimpleNamespace

    from batchinfer.strategies.sipipe.executor import ColumnPlan, SiPipeExecutor

    pool = SimpleNamespace(results=defaultdict(deque), expert_loads=defaultdict(dict),
                           send=lambda rank, message: None)
    layout = SimpleNamespace(replica_ranks=lambda replica: [0, 1], pp=2)
    executor = SiPipeExecutor(pool, layout, 0, None, 10.0, [2, 3, 4],
                              PoolLayout.of(2, 6, True, 3), seed=0)
    plan = ColumnPlan(5, [], [], [], [], [0, 1, 3], ["a", "b", "c"], [0, 0, 0],
                      sample_columns=[2, 0, 1])
    batch = SimpleNamespace(items=[None] * 4)
    executor._in_flight.append((5, batch, plan))
    queue = pool.results[0]
    for message in (_share(5, 2, [12], 0.2), _share(6, 0, [60], 0.1), _share(5, 0, [10], 0.3)):
        queue.append(message)
        assert not executor.ready()
    queue.append(_share(5, 1, [11], 0.1))
    assert executor.ready()
    _, result = executor.collect()
    assert result.tokens == [12, 10, None, 11] and result.sample_s == 0.3
    assert [m["mb_id"] for m in queue] == [6]
    assert executor.strategy_summary()["cpu_sampling_ms_per_micro_batch"] == 300.0


def test_pool_keys_in_a_recipe():
    strategy = parse_recipe({"strategy": {"name": "sipipe", "samplers": 3, "sampler_threads": 2},
                             "parallel": {"pp": 2}}).engine_config().strategy
    assert strategy.sampler_pool(2) == PoolLayout.of(2, 256, True, 3)
    assert parse_recipe({"strategy": {"name": "sipipe", "split_columns": False}}
                        ).engine_config().strategy.sampler_pool(2).samplers == 2
    assert parse_recipe({"strategy": {"name": "sipipe"}}).engine_config().strategy.pool_size(4) == 4
    with pytest.raises(RecipeError, match="samplers: 3 needs split_columns: true"):
        parse_recipe({"strategy": {"name": "sipipe", "samplers": 3, "split_columns": False}})
    for bad in (0, True, "2"):
        with pytest.raises(RecipeError, match="strategy.samplers: a whole number"):
            parse_recipe({"strategy": {"name": "sipipe", "samplers": bad}})
