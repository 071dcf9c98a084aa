"""What B_th is derived from (§4.3, "offline profiling"), measured by the ranks at startup: the FFN
path of one forward in each mode, in the tail the switch is for (replica 0 has B rows, the others
have run dry), for B = 1 .. 64:
- WaS: replica 0 alone runs every FFN, the remote layers' from its weight slots (filled by the
  prefetch thread, as in a forward);
- CaS: a real round of the compute service (rows [B, 0, ...]): replica 0 sends the remote layers'
  inputs to their owners, which serve them as dummies.
Measured in the workers, with their thread counts, before the first plan. The attention and the
rest of the layer are the same in both modes, so they are left out.
"""
from __future__ import annotations

import torch

from batchinfer.engine.runtime import transport
from batchinfer.engine.timing import median_seconds
from .compute_service import ServiceStats, ffn
from .weight_slots import SlotStats

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def profile_modes(rank_ffn, dp: int, ops, device: torch.device, repeats: int = 3) -> dict:
    """rank_ffn: the rank's shared_ffn.RankFFN, slots started. -> {"was_s": {rows: seconds},
    "cas_s": {rows: seconds}} on replica 0 ({} elsewhere). Every replica must call it at the same
    point: the CaS rounds need them all."""
    service, slots = rank_ffn.service, rank_ffn.slots
    replica, owners, store = service.replica, service.owners, service.store

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def was_pass(x):
        for layer, owner in enumerate(owners):
            if owner == replica or not slots.order:
                ffn(x, store.view(layer), ops)
            else:
                ffn(x, slots.acquire(layer, 60.0), ops)
                slots.release(layer)
        sync()

    def cas_round(x):
        service.begin(rows)
        for layer in range(len(owners)):
            service.forward(layer, x, ops)
        service.end()
        sync()

    was_s, cas_s = {}, {}
    with torch.inference_mode():
        for size in BATCH_SIZES:
            x = torch.randn((size, store.hidden_size), dtype=store.down.dtype, device=device)
            rows = [size] + [0] * (dp - 1)
            if replica == 0:
                was_s[size] = median_seconds(lambda: was_pass(x), repeats)
            transport.barrier()
            if replica == 0:
                cas_s[size] = median_seconds(lambda: cas_round(x), repeats)
            else:
                for _ in range(repeats + 1):
                    service.serve_round(rows, ops)
    service.stats, slots.stats = ServiceStats(), SlotStats()   # the profile's are not the job's
    return {"was_s": was_s, "cas_s": cas_s} if replica == 0 else {}
