"""Host-to-device copies that never make the host wait for the GPU.

A copy from pageable host memory to a CUDA device first synchronizes the stream (CUDA's rule for
pageable sources), so each small input tensor a step built with `torch.tensor(..., device=cuda)`
made the host wait for the previous step's kernels. Here a step's host data goes through pinned
memory (torch's caching host allocator: a pinned block is reused once the copy that read it has
finished) and is copied `non_blocking` on a side stream that the compute stream then waits for,
so the host goes on preparing while the GPU computes. The only device-to-host sync left in a
step is reading the sampled token ids.

If pinned memory can't be allocated, copies fall back to pageable memory with one warning.
On CPU these are plain tensors.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

log = logging.getLogger(__name__)
_copy_streams: dict[torch.device, "torch.cuda.Stream"] = {}
_pinning_failed = False


def _stop_pinning(exc: RuntimeError) -> None:
    global _pinning_failed
    _pinning_failed = True
    log.warning("pinned host memory could not be allocated (%s): host-to-device copies fall "
                "back to pageable memory, which makes the host wait for the GPU", exc)


def pinned(cpu: torch.Tensor) -> torch.Tensor:
    """`cpu` in pinned memory (itself when pinning fails: one warning, then pageable copies)."""
    if not _pinning_failed:
        try:
            return cpu.pin_memory()
        except RuntimeError as exc:
            _stop_pinning(exc)
    return cpu


def pinned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor in pinned memory (pageable when pinning fails: one warning)."""
    if not _pinning_failed:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as exc:
            _stop_pinning(exc)
    return torch.empty(shape, dtype=dtype)


def to_device(cpu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new device tensor holding `cpu`, copied on the side stream; the current stream waits for
    the copy before any later kernel reads it."""
    device = torch.device(device)
    if device.type != "cuda":
        return cpu.to(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams[device] = torch.cuda.Stream(device)
    source = pinned(cpu)
    current = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        out = source.to(device, non_blocking=True)
    current.wait_stream(stream)
    out.record_stream(current)          # freed only once the compute stream is done with it
    return out


def copy_into(dest: torch.Tensor, cpu: torch.Tensor) -> None:
    """dest (a device buffer, e.g. a CUDA graph's static input) <- cpu, without a host wait."""
    if dest.is_cuda:
        dest.copy_(pinned(cpu), non_blocking=True)
    else:
        dest.copy_(cpu)


def packed_to_device(parts: dict[str, list], dtypes: dict[str, torch.dtype],
                     device: torch.device, carrier: torch.dtype = torch.int64,
                     one_copy: Optional[bool] = None) -> dict[str, torch.Tensor]:
    """Several host lists as tensors on `device`. one_copy (default: on CUDA): concatenated into
    one `carrier` tensor, moved with to_device, split into views and cast to each part's dtype
    on the device; else one plain tensor per part (on CPU there is no copy to save)."""
    if not (one_copy if one_copy is not None else torch.device(device).type == "cuda"):
        return {name: torch.tensor(values, dtype=dtypes[name], device=device)
                for name, values in parts.items()}
    flat: list = []
    bounds = []
    for name in parts:
        start = len(flat)
        flat.extend(parts[name])
        bounds.append((name, start, len(flat)))
    moved = to_device(torch.tensor(flat, dtype=carrier), device)
    out = {}
    for name, start, end in bounds:
        view = moved[start:end]
        out[name] = view if dtypes[name] == carrier else view.to(dtypes[name])
    return out
