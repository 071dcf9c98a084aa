"""The CPU KV cache in transparent huge pages (engine/kv_cache.py)."""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.kv_cache import HUGE_PAGE, KVCacheSpec, allocate_kv_tensors


def _spec() -> KVCacheSpec:
    return KVCacheSpec(num_layers=3, num_blocks=40, block_size=16, num_kv_heads=2, head_dim=64,
                       dtype_bytes=4)


def test_huge_page_kv_is_aligned_zeroed_and_each_layer_its_own(monkeypatch):
    monkeypatch.setenv("BATCHINFER_KV_HUGE_PAGES", "1")
    caches = allocate_kv_tensors(_spec(), torch.float32, "cpu")
    base = caches[0][0].data_ptr()
    assert base % HUGE_PAGE == 0  # our mapping: torch's own allocator never aligns this far
    assert len(caches) == 3
    for key, value in caches:
        assert key.shape == value.shape == (40, 2, 16, 64) and key.dtype == torch.float32
        assert not key.any() and not value.any()
    caches[1][0][7, 1, 3] = 1.5
    caches[2][1][0] = -2.0
    assert caches[1][0].sum() == 1.5 * 64 and caches[0][0].sum() == 0 and caches[1][1].sum() == 0
    assert caches[2][1].sum() == -2.0 * 2 * 16 * 64


def test_the_switch_turns_huge_pages_off(monkeypatch):
    monkeypatch.setenv("BATCHINFER_KV_HUGE_PAGES", "0")
    caches = allocate_kv_tensors(_spec(), torch.bfloat16, "cpu")
    assert caches[0][0].data_ptr() % HUGE_PAGE != 0 and caches[0][0].dtype == torch.bfloat16
    assert not caches[2][1].any()


def test_a_signal_during_the_first_touch_is_answered_before_it_ends():
    """Faulting in GiBs of cache takes seconds; the touch goes a piece at a time, so a signal's
    handler (a stop during setup raises from it) runs between pieces, not after the last:
    measured against a whole touch in the same test."""
    import signal
    import time

    from batchinfer.engine.kv_cache import TOUCH_BYTES, _huge_page_storage

    class Stop(Exception):
        pass

    shape = (8 * TOUCH_BYTES // 4,)                 # eight pieces of float32
    if _huge_page_storage(shape, torch.float32) is None:     # (and the allocator warmed up)
        pytest.skip("no anonymous mappings with MADV_HUGEPAGE here")
    t0 = time.perf_counter()
    _huge_page_storage(shape, torch.float32)
    whole = time.perf_counter() - t0

    def stop(signum, frame):
        raise Stop

    previous = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, whole / 16)
        t0 = time.perf_counter()
        with pytest.raises(Stop):
            _huge_page_storage(shape, torch.float32)
        assert time.perf_counter() - t0 < whole * 0.75
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
