"""Hidden-state transport between adjacent pipeline stages (arXiv:2506.22033 §5.3, Fig. 7).

A stage hands the next one a dict {key: [T, ...] tensor} per micro-batch; T varies, nothing else
does. Two protocols, each counting its messages:

- structure-unaware (vLLM's send_tensor_dict, Fig. 7(a)): every transfer sends the pickled
  metadata's size, the metadata, then each tensor, all blocking. The receiver can post nothing
  early: it learns the shapes only from the metadata, so the stages are coupled and the sender
  stalls until the receiver reaches its wait.
- structure-aware (Fig. 7(b)): the first transfer on a channel is the full protocol; the receiver
  keeps its static structure (keys in order, dtypes, trailing dims). From then on it allocates from
  the plan's token count and posts an irecv per tensor as soon as the plan arrives, and the sender
  isends: no metadata messages, no stall. A structure change is an error (receives are posted early,
  so the protocol cannot switch mid-stream).

Ordering: NCCL ignores tags and matches point-to-point operations per peer pair in issue order, so
both sides issue the same sequence: sender and receiver count transfers, and receive handles posted
before the structure is known are resolved (their irecvs posted) in plan order the moment the first
transfer completes. Gloo matches by tag: each message of a transfer gets its own tag from mb_id.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch

from . import transport

MAX_TENSORS = 14           # tag slots per micro-batch: size, blob, then the tensors
_SLOTS = MAX_TENSORS + 2


@dataclass
class TransferCounters:
    metadata_messages: int = 0
    tensor_messages: int = 0
    bytes: int = 0

    def add_tensor(self, t: torch.Tensor) -> None:
        self.tensor_messages += 1
        self.bytes += t.numel() * t.element_size()


def _tag(mb_id: int, slot: int) -> int:
    return (mb_id % (1 << 20)) * _SLOTS + slot


def _structure(tensors: dict[str, torch.Tensor]) -> tuple:
    """The static part: ((key, dtype, trailing dims), ...) in key order."""
    return tuple((key, t.dtype, tuple(t.shape[1:])) for key, t in tensors.items())


class _InFlight:
    """An isend's work that also keeps its (contiguous) buffer alive until reaped."""

    def __init__(self, work, tensor: torch.Tensor):
        self.work, self.tensor = work, tensor

    def wait(self, *args):
        return self.work.wait(*args)

    def is_completed(self) -> bool:
        return self.work.is_completed()


class StageSender:
    def __init__(self, peer: int, device: torch.device, structure_aware: bool):
        self.peer, self.device, self.structure_aware = peer, torch.device(device), structure_aware
        self.counters = TransferCounters()
        self.transfers = 0
        self.structure: tuple | None = None

    def send(self, mb_id: int, tensors: dict[str, torch.Tensor]) -> list:
        """Sends `tensors` for micro-batch `mb_id`; -> works still in flight ([] when all blocking).
        The caller waits them (or checks is_completed) later."""
        if len(tensors) > MAX_TENSORS:
            raise ValueError(f"at most {MAX_TENSORS} tensors per transfer, got {len(tensors)}")
        tensors = {key: t.contiguous() for key, t in tensors.items()}
        if not self.structure_aware:
            self._send_full(mb_id, tensors)
            return []
        if self.structure is None:
            rows = {t.shape[0] if t.dim() else None for t in tensors.values()}
            if len(rows) != 1 or None in rows:
                shapes = [tuple(t.shape) for t in tensors.values()]
                raise ValueError("structure-aware transport needs every tensor to share its "
                                 f"leading (token) dimension; got {shapes}")
            self._send_full(mb_id, tensors)
            self.structure = _structure(tensors)
            return []
        self._check(tensors)
        works = []
        for slot, t in enumerate(tensors.values(), start=2):
            work = transport.isend(t, dst=self.peer, tag=_tag(mb_id, slot))
            # a staged send keeps its host copy; the device tensor can go
            works.append(work if isinstance(work, transport.StagedSend) else _InFlight(work, t))
            self.counters.add_tensor(t)
        self.transfers += 1
        return works

    def _check(self, tensors: dict[str, torch.Tensor]) -> None:
        expected = {key: (dtype, dims) for key, dtype, dims in self.structure}
        if list(tensors) != list(expected):
            raise ValueError(f"structure-aware transfer {self.transfers}: keys {list(tensors)} "
                             f"differ from the first transfer's {list(expected)}")
        rows = None
        for key, t in tensors.items():
            dtype, dims = expected[key]
            got = (t.dtype, tuple(t.shape[1:]))
            if t.dim() == 0 or got != (dtype, dims):
                raise ValueError(f"structure-aware transfer {self.transfers}: tensor {key!r} is "
                                 f"{t.dtype} {tuple(t.shape)}, the first transfer fixed {dtype} "
                                 f"[T, {', '.join(map(str, dims))}]")
            if rows is not None and t.shape[0] != rows:
                raise ValueError(f"structure-aware transfer {self.transfers}: tensor {key!r} has "
                                 f"{t.shape[0]} rows, the others {rows}")
            rows = t.shape[0]

    def _send_full(self, mb_id: int, tensors: dict[str, torch.Tensor]) -> None:
        meta = [(key, t.dtype, tuple(t.shape)) for key, t in tensors.items()]
        blob = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([blob.numel()], dtype=torch.int64, device=self.device)
        transport.send(size, dst=self.peer, tag=_tag(mb_id, 0))
        transport.send(blob, dst=self.peer, tag=_tag(mb_id, 1))
        self.counters.metadata_messages += 2
        self.counters.bytes += size.numel() * 8 + blob.numel()
        for slot, t in enumerate(tensors.values(), start=2):
            transport.send(t, dst=self.peer, tag=_tag(mb_id, slot))
            self.counters.add_tensor(t)
        self.transfers += 1


class PendingReceive:
    """One micro-batch's incoming tensors. Modes: 'posted' (irecvs in flight), 'full' (runs the
    blocking metadata protocol at wait), 'lazy' (posted before the structure was known; its
    irecvs are posted in plan order once the first transfer completes)."""

    def __init__(self, receiver: "StageReceiver", mb_id: int, num_tokens: int, mode: str):
        self.receiver, self.mb_id, self.num_tokens, self.mode = receiver, mb_id, num_tokens, mode
        self.tensors: dict[str, torch.Tensor] | None = None
        self.works: list = []
        self.done = False

    def _post(self, structure: tuple) -> None:
        r = self.receiver
        self.tensors = {}
        for slot, (key, dtype, dims) in enumerate(structure, start=2):
            t = torch.empty((self.num_tokens, *dims), dtype=dtype, device=r.device)
            self.works.append(transport.irecv(t, src=r.peer, tag=_tag(self.mb_id, slot)))
            self.tensors[key] = t
            r.counters.add_tensor(t)
        self.mode = "posted"

    def wait(self) -> dict[str, torch.Tensor]:
        if self.done:
            return self.tensors
        if self.mode == "lazy":
            raise RuntimeError(f"micro-batch {self.mb_id}: receives must be waited in post order "
                               "(the first transfer on this channel has not completed)")
        if self.mode == "full":
            self.tensors = self.receiver._recv_full(self)
        for work in self.works:
            work.wait()
        self.works, self.done = [], True
        return self.tensors


class StageReceiver:
    def __init__(self, peer: int, device: torch.device, structure_aware: bool):
        self.peer, self.device, self.structure_aware = peer, torch.device(device), structure_aware
        self.counters = TransferCounters()
        self.posts = 0
        self.structure: tuple | None = None
        self._unresolved: list[PendingReceive] = []   # lazy handles, in plan order

    def post(self, mb_id: int, num_tokens: int) -> PendingReceive:
        """Call when the plan arrives, in plan order; -> the handle to wait at execute time."""
        if not self.structure_aware or self.posts == 0:
            mode = "full"
        elif self.structure is None:
            mode = "lazy"
        else:
            mode = "posted"
        self.posts += 1
        handle = PendingReceive(self, mb_id, num_tokens, mode)
        if mode == "posted":
            handle._post(self.structure)
        elif mode == "lazy":
            self._unresolved.append(handle)
        return handle

    def _recv_full(self, handle: PendingReceive) -> dict[str, torch.Tensor]:
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        transport.recv(size, src=self.peer, tag=_tag(handle.mb_id, 0))
        blob = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        transport.recv(blob, src=self.peer, tag=_tag(handle.mb_id, 1))
        self.counters.metadata_messages += 2
        self.counters.bytes += 8 + blob.numel()
        meta = pickle.loads(blob.cpu().numpy().tobytes())
        tensors = {}
        for slot, (key, dtype, shape) in enumerate(meta, start=2):
            t = torch.empty(shape, dtype=dtype, device=self.device)
            transport.recv(t, src=self.peer, tag=_tag(handle.mb_id, slot))
            tensors[key] = t
            self.counters.add_tensor(t)
        if self.structure_aware and self.structure is None:
            bad = [key for key, _, shape in meta if not shape or shape[0] != handle.num_tokens]
            if bad:
                raise ValueError(f"micro-batch {handle.mb_id}: tensors {bad} do not have the "
                                 f"plan's {handle.num_tokens} rows; structure-aware transport "
                                 "cannot infer their shapes")
            self.structure = tuple((key, dtype, tuple(shape[1:])) for key, dtype, shape in meta)
            for lazy in self._unresolved:     # same order as the sender's isends
                lazy._post(self.structure)
            self._unresolved = []
        return tensors
