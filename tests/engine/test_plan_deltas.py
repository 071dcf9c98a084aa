"""Block tables sent as changes (engine/runtime/plan_deltas.py, SiPipe's SequenceCache): the worker's
tables equal the controller's after every plan, through appends, resets, shrinks, releases with
handle reuse and several layer groups; the plans the controller keeps are not touched; a decode
step of long contexts travels in a fraction of the bytes."""
from __future__ import annotations

import pickle
import random

import pytest

from batchinfer.engine.runtime.plan_deltas import TableCache, TableEncoder
from batchinfer.engine.step_plan import StepPlan


def _plan(mb_id: int, tables: list[list[int]], groups: list[list[list[int]]] = ()) -> StepPlan:
    n = len(tables)
    return StepPlan(mb_id, list(range(n)), [1] * n, [16 * len(t) for t in tables],
                    [list(t) for t in tables], list(range(n)), [f"r{i}" for i in range(n)],
                    [1] * n, group_tables=[[list(t) for t in g] for g in groups])


def _over_the_pipe(plan):
    return pickle.loads(pickle.dumps(plan))


def test_random_table_histories_arrive_whole_at_the_worker():
    rng = random.Random(3)
    encoder, cache = TableEncoder(), TableCache()
    live: dict[str, list[list[int]]] = {}       # seq -> [group 0 table, group 1 table]
    next_id, next_block, peak = 0, 1, 0
    handed_out = []
    for mb_id in range(400):
        for _ in range(rng.randint(0, 2)):        # arrivals
            live[f"s{next_id}"] = [[], []]
            next_id += 1
        for seq in list(live):
            roll = rng.random()
            for tables in live[seq]:
                if roll < 0.5:                    # a decode step that filled a block
                    tables.append(next_block)
                    next_block += 1
                elif roll < 0.55:                 # preempted and re-admitted: new blocks
                    tables[:] = [next_block + i for i in range(len(tables))]
                    next_block += len(tables)
                elif roll < 0.58 and tables:      # a window release: a placeholder up front
                    tables[0] = 0
                elif roll < 0.6 and tables:       # shrunk
                    tables.pop()
        if live and rng.random() < 0.3:           # a finished sequence
            gone = rng.choice(sorted(live))
            del live[gone]
            encoder.release(gone)
        chosen = [s for s in sorted(live) if rng.random() < 0.7]
        plan = _plan(mb_id, [live[s][0] for s in chosen], [[live[s][1] for s in chosen]])
        kept = [list(t) for t in plan.block_tables]
        sent = encoder.encode(plan, chosen)
        assert plan.block_tables == kept and plan.table_deltas is None   # the controller's copy
        got = cache.apply(_over_the_pipe(sent))
        assert got.block_tables == [live[s][0] for s in chosen]
        assert got.group_tables == [[live[s][1] for s in chosen]]
        assert got.table_deltas is None
        handed_out.append((got.block_tables, [list(t) for t in got.block_tables]))
        assert set(cache._tables[0]) <= set(encoder._handles.values())   # dropped: forgotten
        peak = max(peak, len(encoder._handles))
    for tables, snapshot in handed_out:           # later plans never changed an earlier one's
        assert tables == snapshot
    assert max(encoder._handles.values(), default=0) < peak      # released handles are reused


def test_an_unchanged_table_travels_as_nothing():
    encoder, cache = TableEncoder(), TableCache()
    tables = [list(range(i * 128, (i + 1) * 128)) for i in range(256)]   # 2,048-token contexts
    seqs = [f"s{i}" for i in range(256)]
    full = len(pickle.dumps(_plan(0, tables)))
    first = pickle.dumps(encoder.encode(_plan(0, tables), seqs))
    cache.apply(pickle.loads(first))
    for table in tables[:16]:                     # a block added for 16 of them
        table.append(table[-1] + 100_000)
    step = pickle.dumps(encoder.encode(_plan(1, tables), seqs))
    assert cache.apply(pickle.loads(step)).block_tables == tables
    assert len(first) > 0.9 * full
    assert len(step) < 0.2 * full


def test_plans_without_deltas_pass_through():
    cache = TableCache()
    plan = _plan(0, [[1, 2], [3]])
    assert cache.apply(plan).block_tables == [[1, 2], [3]]


def test_a_worker_that_missed_a_plan_says_the_caches_disagree():
    encoder, cache = TableEncoder(), TableCache()
    encoder.encode(_plan(0, [[1, 2, 3]]), ["s"])              # never reaches the worker
    with pytest.raises(RuntimeError, match="caches disagree"):
        cache.apply(encoder.encode(_plan(1, [[1, 2, 3, 4]]), ["s"]))


def test_tables_that_grow_in_place_between_plans_are_sent_as_they_grew():
    """The block manager hands out its own lists and appends to them: the encoder must keep a
    copy of what it sent, not the list itself, or every later block would go unsent."""
    encoder, cache = TableEncoder(), TableCache()
    live = [[1, 2], [3]]                      # the block manager's lists, the same objects
    for mb_id in range(5):
        plan = StepPlan(mb_id, [0, 0], [1, 1], [1, 1], live, [0, 1], ["a", "b"], [1, 1])
        got = cache.apply(_over_the_pipe(encoder.encode(plan, ["a", "b"])))
        assert got.block_tables == live
        live[0].append(10 + mb_id)
        if mb_id % 2:
            live[1].append(20 + mb_id)
