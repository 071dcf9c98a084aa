"""The per-worker prefetcher (Seesaw §5.2): a background thread that copies KV between the
rank's paged cache and the CPU store while the main thread computes, and reports each finished
copy to the controller, which then lets the sequence decode (swap-in) or frees its device blocks
(swap-out).

`threaded=False` is the ablation without the asynchronous pipeline: the copy runs on the main
thread when the request arrives, between micro-batches. Each report names the thread that did the
copies, so the report (and the tests) can see which one it was.

On CUDA the copies go through `CudaKvCopier` (a copy stream, pinned staging buffers, events):
`submit` records an event on the worker's compute stream that the copy waits for, so neither
thread ever synchronizes the device.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Optional

import torch

from batchinfer.engine.cpu_binding import release_helper_thread

from .cuda_kv_copies import CudaKvCopier
from .kv_store import ShardView, swap_in, swap_out


class Prefetcher:
    THREAD_NAME = "kv-prefetcher"

    def __init__(self, store: torch.Tensor, notify: Callable[[list[int], float, str], None],
                 threaded: bool = True):
        self.store = store
        self.notify = notify
        self.paged: Optional[torch.Tensor] = None
        self.view: Optional[ShardView] = None
        self.busy_s = 0.0
        self._queue: "queue.Queue" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._thread = None
        self.copier: Optional[CudaKvCopier] = None      # made at the first CUDA attach
        if threaded:
            self._thread = threading.Thread(target=self._loop, name=self.THREAD_NAME,
                                            daemon=True)
            self._thread.start()

    def attach(self, paged: torch.Tensor, view: ShardView) -> None:
        """The rank's paged storage and shard in the current layout (set at each re-shard, with
        the queue drained)."""
        self.paged, self.view = paged, view
        if paged.is_cuda and self.copier is None:
            self.copier = CudaKvCopier(paged.device)

    def submit(self, transfer_id: int, kind: str, device_blocks, store_blocks,
               table_blocks=()) -> None:
        """Queues one transfer's copy (`table_blocks`: its blocks per table, which tells each
        block's layer group)."""
        self.raise_error()
        after = self.copier.mark() if self.copier is not None else None
        task = (transfer_id, kind, list(device_blocks), list(store_blocks), tuple(table_blocks),
                after)
        if self._thread is None:
            self._run([task])
        else:
            self._queue.put(task)

    def drain(self) -> None:
        """Blocks until every submitted copy is done (before the layout changes)."""
        if self._thread is not None:
            self._queue.join()
        self.raise_error()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5.0)

    def raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"KV prefetcher failed: {self._error!r}") from self._error

    def _loop(self) -> None:
        release_helper_thread()
        with torch.inference_mode():
            while True:
                task = self._queue.get()
                if task is None:
                    self._queue.task_done()
                    return
                batch = [task]
                while True:   # whatever else is queued goes in the same report
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        self._queue.put(None)
                        self._queue.task_done()
                        break
                    batch.append(more)
                try:
                    self._run(batch)
                except BaseException as exc:  # noqa: BLE001 - surfaced on the main thread
                    self._error = exc
                finally:
                    for _ in batch:
                        self._queue.task_done()

    def _run(self, tasks: list) -> None:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _tid, kind, device_blocks, store_blocks, table_blocks, after in tasks:
                if self.copier is not None:
                    copy = self.copier.swap_out if kind == "out" else self.copier.swap_in
                    copy(self.store, self.paged, self.view, device_blocks, store_blocks, after,
                         table_blocks)
                else:
                    copy = swap_out if kind == "out" else swap_in
                    copy(self.store, self.paged, self.view, device_blocks, store_blocks,
                         table_blocks)
        spent = time.perf_counter() - t0
        self.busy_s += spent
        self.notify([t[0] for t in tasks], spent, threading.current_thread().name)
