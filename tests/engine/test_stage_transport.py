"""Stage-to-stage hidden-state transport (structure-aware vs -unaware) between two gloo ranks.

One spawned pair of processes runs every scenario (spawning costs seconds on 2 cores); the tests
check what each scenario reported. Every wait has a timeout, so a protocol mismatch (a hang) fails.
"""
from __future__ import annotations

import datetime
import queue as queue_mod

import pytest
import torch

HIDDEN = 576
TOKENS = [1, 7, 64, 3, 128, 1, 33, 2, 256, 5]
AHEAD = 3          # the receiver keeps up to this many plans posted
TIMEOUT_S = 60


def _tensors(mb_id: int, tokens: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + mb_id)
    return {"hidden": torch.randn(tokens, HIDDEN, generator=gen).to(dtype),
            "residual": torch.randn(tokens, HIDDEN, generator=gen).to(dtype)}


def _counters(c) -> dict:
    return {"metadata_messages": c.metadata_messages, "tensor_messages": c.tensor_messages,
            "bytes": c.bytes}


def _run_transfers(rank: int, aware: bool, base: int) -> dict:
    from batchinfer.engine.runtime.stage_transport import StageReceiver, StageSender

    cpu = torch.device("cpu")
    if rank == 0:
        sender = StageSender(1, cpu, structure_aware=aware)
        reaped = 0
        inflight = []
        for i, tokens in enumerate(TOKENS):
            inflight += sender.send(base + i, _tensors(base + i, tokens))
        for work in inflight:
            work.wait()
            reaped += 1
        return {"counters": _counters(sender.counters), "inflight": reaped}
    receiver = StageReceiver(0, cpu, structure_aware=aware)
    handles, mismatched = [], []
    for i, tokens in enumerate(TOKENS[:AHEAD]):      # three plans arrive before any executes
        handles.append(receiver.post(base + i, tokens))
    for i, tokens in enumerate(TOKENS):
        got = handles[i].wait()
        if i + AHEAD < len(TOKENS):
            handles.append(receiver.post(base + i + AHEAD, TOKENS[i + AHEAD]))
        want = _tensors(base + i, tokens)
        if list(got) != list(want) or not all(torch.equal(got[k], want[k]) for k in want):
            mismatched.append(i)
    return {"counters": _counters(receiver.counters), "mismatched": mismatched}


def _run_changed_dtype(rank: int, base: int) -> dict:
    from batchinfer.engine.runtime.stage_transport import StageReceiver, StageSender

    cpu = torch.device("cpu")
    if rank == 0:
        sender = StageSender(1, cpu, structure_aware=True)
        works = []
        for i in range(5):
            works += sender.send(base + i, _tensors(base + i, TOKENS[i]))
        bad = _tensors(base + 5, TOKENS[5])
        bad["residual"] = bad["residual"].to(torch.float64)
        error = None
        try:
            sender.send(base + 5, bad)
        except ValueError as exc:
            error = str(exc)
        for work in works:
            work.wait()
        return {"error": error}
    receiver = StageReceiver(0, cpu, structure_aware=True)
    for i in range(5):            # the receiver never posts transfer 5: the sender refuses it
        receiver.post(base + i, TOKENS[i]).wait()
    return {}


def _rank_main(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    try:
        out = {"aware": _run_transfers(rank, True, base=0),
               "unaware": _run_transfers(rank, False, base=100),
               "changed_dtype": _run_changed_dtype(rank, base=200)}
        dist.barrier()
        results.put((rank, out))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, {"exception": repr(exc)}))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcome():
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, None, True,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, store.port, results), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, out = results.get(timeout=TIMEOUT_S)
            got[rank] = out
    except queue_mod.Empty:
        pytest.fail(f"transport ranks hung (got results from {sorted(got)})")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, out in got.items():
        assert "exception" not in out, f"rank {rank}: {out['exception']}"
    return got


@pytest.mark.slow
def test_structure_aware_sends_metadata_once(outcome):
    sender, receiver = outcome[0]["aware"], outcome[1]["aware"]
    assert receiver["mismatched"] == []
    assert sender["counters"]["metadata_messages"] == 2
    assert sender["counters"]["tensor_messages"] == 2 * len(TOKENS)
    assert receiver["counters"]["metadata_messages"] == 2
    assert receiver["counters"]["tensor_messages"] == 2 * len(TOKENS)
    assert sender["inflight"] == 2 * (len(TOKENS) - 1)     # all but the first transfer async
    payload = sum(TOKENS) * HIDDEN * 4 * 2
    assert receiver["counters"]["bytes"] == sender["counters"]["bytes"] > payload


@pytest.mark.slow
def test_structure_unaware_sends_metadata_every_transfer(outcome):
    sender, receiver = outcome[0]["unaware"], outcome[1]["unaware"]
    assert receiver["mismatched"] == []
    for side in (sender, receiver):
        assert side["counters"]["metadata_messages"] == 2 * len(TOKENS)
        assert side["counters"]["tensor_messages"] == 2 * len(TOKENS)
    assert sender["inflight"] == 0
    assert receiver["counters"]["bytes"] == sender["counters"]["bytes"]


@pytest.mark.slow
def test_structure_aware_rejects_a_changed_dtype(outcome):
    error = outcome[0]["changed_dtype"]["error"]
    assert error is not None and "'residual'" in error and "torch.float64" in error


def test_tags_are_distinct_per_message():
    from batchinfer.engine.runtime.stage_transport import _SLOTS, _tag

    tags = {_tag(mb, slot) for mb in range(50) for slot in range(_SLOTS)}
    assert len(tags) == 50 * _SLOTS


def test_a_handle_posted_before_the_structure_is_known_must_wait_in_order():
    from batchinfer.engine.runtime.stage_transport import StageReceiver

    receiver = StageReceiver(0, torch.device("cpu"), structure_aware=True)
    first, second = receiver.post(0, 4), receiver.post(1, 4)   # no messages yet: nothing posted
    assert (first.mode, second.mode) == ("full", "lazy")
    with pytest.raises(RuntimeError, match="post order"):
        second.wait()
