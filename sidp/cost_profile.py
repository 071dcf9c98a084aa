"""What B_th is derived from, measured by the ranks themselves at startup (§4.3, "offline
profiling"): one layer's FFN time against batch rows, one layer's weight read into a slot, and one
activation transfer between two replicas. Measured in the workers, with their thread counts and
while the other replicas measure too (as they run), before the weight slots start reading.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .compute_service import ffn
from .ffn_store import FFNStore

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PING_TAG = 1 << 20           # clear of the CaS transfers, which are tagged with their layer


def _median_time(fn, repeats: int) -> float:
    fn()                      # warm-up (allocator, kernel selection)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_costs(store: FFNStore, owners: list[int], replica: int, ops, device: torch.device,
                  repeats: int = 5, pings: int = 20) -> dict:
    """-> {"ffn_s": {rows: seconds}, "fetch_s": ..., "p2p_s": ... (replicas 0 and 1 measure it
    between them; others report None)}."""
    owned = next(layer for layer, owner in enumerate(owners) if owner == replica)
    remote = next(layer for layer, owner in enumerate(owners) if owner != replica)
    hidden = store.down.shape[1]
    dtype = store.down.dtype
    x = torch.randn((BATCH_SIZES[-1], hidden), dtype=dtype, device=device)
    weights = store.view(owned)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with torch.inference_mode():
        ffn_s = {rows: _median_time(lambda rows=rows: (ffn(x[:rows], weights, ops), sync()),
                                    repeats) for rows in BATCH_SIZES}
        slot = {name: torch.empty(shape, dtype=dtype, device=device)
                for name, shape in store.layer_shapes().items()}
        fetch_s = _median_time(lambda: (store.read_into(remote, slot), sync()), repeats)
    return {"ffn_s": ffn_s, "fetch_s": fetch_s, "p2p_s": _ping(replica, hidden, dtype, device,
                                                               pings)}


def _ping(replica: int, hidden: int, dtype, device, pings: int):
    """Half the median round trip of a one-row activation between replicas 0 and 1."""
    if replica > 1:
        return None
    peer = 1 - replica
    buffer = torch.zeros((1, hidden), dtype=dtype, device=device)
    times = []
    for _ in range(pings + 3):
        t0 = time.perf_counter()
        if replica == 0:
            dist.send(buffer, peer, tag=PING_TAG)
            dist.recv(buffer, peer, tag=PING_TAG)
        else:
            dist.recv(buffer, peer, tag=PING_TAG)
            dist.send(buffer, peer, tag=PING_TAG)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) / 2
