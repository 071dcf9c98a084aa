"""The hooks a strategy's worker-level mechanism plugs into a worker process (runtime/worker.py).

The worker names no strategy: it calls these hooks, whose defaults are the plain worker. A
strategy that works below the scheduler (re-sharding between layouts, CPU sampling and
token-safe inputs, FFN weights shared between replicas) subclasses WorkerExtension in its own folder and
hands one instance per rank to the engine's start_workers(); it is pickled into the worker
process, so the fields a subclass declares are its per-rank setup data and the state it builds
in `setup` lives only in that process.
"""
from __future__ import annotations

from typing import Optional


class WorkerExtension:
    # the stage transport: receives posted from the plan, no metadata after the first transfer
    # (False: per-transfer metadata and blocking receives, as vLLM's send_tensor_dict)
    structure_aware: bool = True
    # prepare each plan's inputs one plan ahead on a thread (runtime/input_prep.py)
    token_safe_inputs: bool = False
    # pack the model's linears for the native GEMM at build time (False: the strategy packs
    # what it keeps, after it has replaced the rest)
    pack_linears: bool = True

    def extra_layouts(self) -> list:
        """Layouts beyond the recipe's the workers will also run (their TP groups get buffers)."""
        return []

    def host_weight_bytes(self, arch, world_size: int, dummy: bool) -> tuple[int, str]:
        """(bytes, what keeps them) of weights all `world_size` ranks together hold in host
        memory beside their partitions (`dummy`: model.load_format dummy), checked against the
        host's memory before the workers start; (0, "") for none."""
        return 0, ""

    def roles(self, worker) -> None:
        """After the worker set its place in the current layout: may change who samples
        (`worker.samples`) or where the last stage's logits go (`worker.logits_out`)."""

    def build_partition(self, worker, arch) -> bool:
        """Build the worker's model and KV cache itself (True), or leave it to the worker."""
        return False

    def setup(self, worker) -> dict:
        """Once the model is built: the strategy's own setup. -> extra fields of the worker's
        "ready" message."""
        return {}

    def message(self, worker, message: tuple, pending) -> bool:
        """A control message the worker does not know; True when handled. `pending`: the plans
        received and not yet executed (oldest first: (plan, posted receives))."""
        return False

    def execute(self, worker, plan, received) -> bool:
        """Run `plan` the strategy's way (True), or leave it to the worker's plain forward."""
        return False

    def result_stats(self, worker) -> Optional[dict]:
        """Counters that ride on each result the worker sends (None: none)."""
        return None

    def close(self, worker) -> None:
        """The worker stops: join the strategy's threads, release what it holds."""
