"""A rank's cache of remote FFN weights: preallocated slots, filled ahead of use (§4.2).

A background thread walks the rank's prefetch order (ownership.prefetch_order, repeated for
every forward pass): it reserves a free slot, reads the layer's weights from the owner's store
into it and marks it ready. The forward, reaching a non-owned layer, waits for its slot (usually
already filled: a hit), computes, and releases it; the thread (the housekeeper) sees the release,
frees the slot and fills it with the next layer in the order. The slot count bounds how far
ahead the reads run (the lookahead window). Slots are never allocated or freed while running.

On CUDA the reads run on a copy stream of their own and nothing waits on the host: a slot's
release records an event on the compute stream, which the next read into that slot waits for
(the forward that used it may still be running); a read records an event the forward's stream
waits for before it computes from the slot.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

from batchinfer.engine.cpu_binding import release_helper_thread


@dataclass
class SlotStats:
    fetches: int = 0
    bytes: int = 0
    hits: int = 0            # the forward found the layer already fetched
    waits: int = 0
    wait_s: float = 0.0


class WeightSlots:
    def __init__(self, store, order: list[int], num_slots: int, device: torch.device,
                 start: bool = True):
        if order and num_slots < 1:
            raise ValueError("a rank that reads remote layers needs at least one weight slot")
        if num_slots > len(order):   # a layer would be fetched again before its copy is used
            raise ValueError(f"{num_slots} weight slots for {len(order)} remote layers")
        self.store, self.order = store, order
        self.slots = [{name: torch.empty(shape, dtype=store.gate_up.dtype, device=device)
                       for name, shape in store.layer_shapes().items()}
                      for _ in range(num_slots)]
        self.stats = SlotStats()
        self._cond = threading.Condition()
        self._free = list(range(num_slots))
        self._ready: dict[int, int] = {}      # layer -> slot, filled
        self._in_use: dict[int, int] = {}     # layer -> slot, taken by the forward
        self._closed = False
        self._error: Optional[BaseException] = None
        self._thread = None
        cuda = torch.device(device).type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if cuda else None
        self._released_at: list = [None] * num_slots   # CUDA: the compute stream's last use
        self._filled_at: list = [None] * num_slots     # CUDA: the copy stream's read
        if start:
            self.start()

    def start(self) -> None:
        """Starts the prefetch thread (once the owners' weights are in the store)."""
        if self.order and self._thread is None:
            self._thread = threading.Thread(target=self._prefetch, name="batchinfer-sidp-slots",
                                            daemon=True)
            self._thread.start()

    # --- the forward's side ---------------------------------------------------------------------
    def acquire(self, layer: int, timeout_s: float) -> dict[str, torch.Tensor]:
        """Waits until `layer`'s weights are in a slot; -> the slot's tensors."""
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            hit = layer in self._ready
            while layer not in self._ready:
                if self._error is not None:
                    raise RuntimeError(f"weight prefetch failed: {self._error}") from self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"layer {layer}'s FFN weights not fetched within "
                                       f"{timeout_s:.0f} s")
                self._cond.wait(left)
            slot = self._ready.pop(layer)
            self._in_use[layer] = slot
            if hit:
                self.stats.hits += 1
            else:
                self.stats.waits += 1
                self.stats.wait_s += time.perf_counter() - start
        if self._filled_at[slot] is not None:
            torch.cuda.current_stream().wait_event(self._filled_at[slot])
        return self.slots[slot]

    def release(self, layer: int) -> None:
        """The forward is done with `layer`'s slot (call after its compute is issued: on CUDA the
        next read into the slot waits for it through an event)."""
        with self._cond:
            slot = self._in_use.pop(layer)
            if self._copy_stream is not None:
                self._released_at[slot] = torch.cuda.Event()
                self._released_at[slot].record()
            self._free.append(slot)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def occupancy(self) -> tuple[int, int, int]:
        """(free, filled and waiting, in use) slots: they always add up to the slot count."""
        with self._cond:
            return len(self._free), len(self._ready), len(self._in_use)

    # --- the prefetch / housekeeper thread -------------------------------------------------------
    def _prefetch(self) -> None:
        release_helper_thread()
        layer_bytes = self.store.layer_bytes()
        position = 0
        while True:
            layer = self.order[position]
            position = (position + 1) % len(self.order)
            with self._cond:
                while not self._closed and not self._free:
                    self._cond.wait()
                if self._closed:
                    return
                slot = self._free.pop()
            try:
                with torch.inference_mode():
                    self._read(layer, slot)
            except BaseException as exc:  # noqa: BLE001 - surfaced to the forward in acquire()
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[layer] = slot
                self.stats.fetches += 1
                self.stats.bytes += layer_bytes
                self._cond.notify_all()

    def _read(self, layer: int, slot: int) -> None:
        if self._copy_stream is None:
            self.store.read_into(layer, self.slots[slot])
            return
        with torch.cuda.stream(self._copy_stream):
            if self._released_at[slot] is not None:
                self._copy_stream.wait_event(self._released_at[slot])
            self.store.read_into(layer, self.slots[slot])
            filled = torch.cuda.Event()
            filled.record(self._copy_stream)
        self._filled_at[slot] = filled
