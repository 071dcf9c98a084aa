"""The last stage's logits to the CPU samplers on CUDA, with no host wait (SiPipe §4, BIC-L: logits
to pinned memory on a side stream).

The logits slots are host shared memory (logits_channel.py). Copied into from a GPU as they are
(pageable), every copy makes the worker's thread wait for the forward and then for the copy, so
the next micro-batch's forward starts late. Here the last stage registers the slots with CUDA once
(cudaHostRegister: pinned, so a device-to-host copy into them is DMA and asynchronous), computes a
micro-batch's logits columns into a device buffer on the compute stream, and copies them into the
slot on a stream of its own once an event says they are written. A sender thread waits for the
copy's event and only then sends the samplers their descriptors, in micro-batch order; the worker
goes on to the next forward meanwhile. If registration fails: one warning, then plain
synchronous copies (the descriptors still go through the thread, so their order is kept); the
failed call's pending CUDA error is drained first, or the next kernel launch would raise it.
A failure of the sender thread is reported to the controller at once (`on_error`): the samplers
would otherwise wait for descriptors that never come.
"""
from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import traceback
from typing import Callable, Optional

import torch

log = logging.getLogger("batchinfer")
_REGISTER_PORTABLE = 1      # cudaHostRegisterPortable


def drain_cuda_error() -> None:
    """Consumes the calling thread's pending CUDA runtime error, which a failed runtime call leaves
    set for the next kernel launch to raise. torch's cudart binding has no cudaGetLastError, so it
    is called in every libcudart this process mapped (torch's wheels name theirs
    libcudart-<hash>.so.N; the error state is per library instance)."""
    getter = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if getter is not None:
        getter()
        return
    paths = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip().removesuffix(" (deleted)")
                if "libcudart" in os.path.basename(path):
                    paths.add(path)
    except OSError:
        return
    for path in paths:
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError):
            pass


def register_pinned(tensors: list[torch.Tensor]) -> bool:
    """Pins host tensors in place (cudaHostRegister); False (and nothing left registered) when
    the driver refuses."""
    cudart = torch.cuda.cudart()
    done: list[torch.Tensor] = []
    for t in tensors:
        status = int(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(),
                                             _REGISTER_PORTABLE))
        if status != 0:
            drain_cuda_error()
            unregister_pinned(done)
            log.warning("SiPipe: the logits slots could not be pinned (cudaError %d): the "
                        "last stage copies its logits synchronously, waiting for the GPU", status)
            return False
        done.append(t)
    return True


def unregister_pinned(tensors: list[torch.Tensor]) -> None:
    cudart = torch.cuda.cudart()
    for t in tensors:
        if int(cudart.cudaHostUnregister(t.data_ptr())) != 0:
            drain_cuda_error()


class CudaLogitsCopier:
    """One last-stage rank's copies from device logits columns to the slots, and the descriptors
    that follow them."""

    def __init__(self, slots: list[torch.Tensor], device: torch.device,
                 on_error: Optional[Callable[[str], None]] = None):
        """on_error: tells the controller the sender thread failed (the detail, a traceback)."""
        self.slots, self.on_error = slots, on_error
        self.pinned = register_pinned(slots)
        self.stream = torch.cuda.Stream(device)
        self._queue: queue.Queue = queue.Queue()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._send_when_copied, daemon=True,
                                        name="batchinfer-sipipe-logits")
        self._thread.start()

    def publish(self, columns: Optional[torch.Tensor], host_out: Optional[torch.Tensor],
                messages: list[tuple]) -> None:
        """Copies `columns` (a device tensor the compute stream is writing; None: nothing to copy)
        into `host_out` (a slot's view), then sends each (conn, message) of `messages`."""
        if self._error is not None:
            raise RuntimeError(f"SiPipe's logits sender failed: {self._error}") from self._error
        done = None
        if columns is not None:
            if self.pinned:
                written = torch.cuda.Event()
                written.record()                          # the compute stream's work so far
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(written)
                    host_out.copy_(columns, non_blocking=True)
                    done = torch.cuda.Event(blocking=True)   # the thread sleeps, not spins
                    done.record(self.stream)
                columns.record_stream(self.stream)        # freed after the copy, not before
            else:
                host_out.copy_(columns)
        self._queue.put((done, messages))

    def _send_when_copied(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            done, messages = item
            try:
                if done is not None:
                    done.synchronize()
                for conn, message in messages:
                    conn.send(message)
            except BaseException as exc:  # noqa: BLE001 - to the controller, and the next publish
                self._error = exc
                if self.on_error is not None:
                    self.on_error(f"SiPipe's logits sender failed: {exc!r}\n"
                                  f"{traceback.format_exc()}")
                return

    def close(self) -> None:
        """Sends what is queued, then unpins the slots (within the worker pool's stop timeout)."""
        self._queue.put(None)
        self._thread.join(timeout=3.0)
        if self.pinned:
            torch.cuda.synchronize()
            unregister_pinned(self.slots)
            self.pinned = False
        if self._error is not None:
            raise RuntimeError(f"SiPipe's logits sender failed: {self._error}") from self._error
