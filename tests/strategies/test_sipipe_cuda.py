"""SiPipe's logits path on CUDA (strategies/sipipe/cuda_logits.py): a sampler is told about a
micro-batch only once its logits are in the slot, however late the forward writes them; a refused
registration leaves no CUDA error behind. CI has no GPU, so these skip there; a lent GPU machine
runs them (benchmarks/engine/cuda_check.sh's `tests`)."""
from __future__ import annotations

import time

import pytest
import torch

from batchinfer.strategies.sipipe.logits_channel import allocate_slots, slot_view
from batchinfer.strategies.sipipe.sampler_pool import PoolLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
VOCAB = 1000


class _SnapshotConn:
    """A sampler's pipe that records what the slot held when the descriptor arrived."""

    def __init__(self, slot: torch.Tensor, width: int):
        self.slot, self.width, self.seen = slot, width, []

    def send(self, message) -> None:
        self.seen.append((message, slot_view(self.slot, VOCAB, self.width).clone()))


def test_a_descriptor_follows_the_copy_of_its_logits():
    from batchinfer.strategies.sipipe.cuda_logits import CudaLogitsCopier

    pool = PoolLayout.of(depth=2, max_num_seqs=4, split=True, samplers=1)
    slots, _ = allocate_slots(pool, VOCAB, pool.slot_columns)
    width = 3
    conn = _SnapshotConn(slots[0], width)
    copier = CudaLogitsCopier(slots, torch.device("cuda"))
    try:
        assert copier.pinned
        columns = torch.zeros((VOCAB, width), device="cuda")
        torch.cuda._sleep(200_000_000)               # the forward is still running ...
        columns.fill_(3.0)                           # ... when it writes the logits
        copier.publish(columns, slot_view(slots[0], VOCAB, width), [(conn, ("logits", 0, 0, 0.1))])
        deadline = time.monotonic() + 30
        while not conn.seen and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        copier.close()
    assert [m for m, _ in conn.seen] == [("logits", 0, 0, 0.1)]
    assert bool((conn.seen[0][1] == 3.0).all())


def test_a_refused_registration_leaves_no_cuda_error_behind():
    from batchinfer.strategies.sipipe.cuda_logits import register_pinned, unregister_pinned

    host = torch.zeros(1 << 20).share_memory_()
    assert register_pinned([host])
    try:
        assert not register_pinned([host])           # already registered: refused
        assert float((torch.ones(4, device="cuda") + 1).sum()) == 8.0   # no stale error raised
    finally:
        unregister_pinned([host])
