"""A worker process: one rank's model partition and KV cache, executing micro-batch plans.

The loop, per plan (plans arrive in pipeline order on the control pipe):
- stages after the first post their receives for (hidden, residual) as soon as the plan arrives:
  the shape is the plan's token count x hidden size, so no metadata travels with the tensors;
- run the partition's layers; the tensor-parallel all-reduces happen inside the model;
- send (hidden, residual) on to the next stage, or, on the last stage, compute the logits of the
  rows that sample and (TP rank 0) sample them and send the tokens to the controller.
Every forward, receive and send is recorded (wall clock) for the pipeline timeline.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import signal
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass

import torch

EVENT_FLUSH_S = 0.5
MAX_PENDING_SENDS = 8


@dataclass
class WorkerSpec:
    rank: int
    layout: object              # ParallelLayout
    model_dir: str
    arch_overrides: dict
    dummy: bool
    seed: int
    dtype: str                  # torch dtype name
    device: str                 # cpu | cuda
    max_model_len: int
    num_blocks: int
    block_size: int
    threads: int
    attention_backend: str
    vocab_size: int
    eos_token_ids: tuple
    timeout_s: float
    store_port: int = 0
    seesaw: object = None       # resharding.worker_layouts.LayoutSpec: two layouts, a CPU KV store


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker if the controller dies (even by kill -9)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker_main(spec: WorkerSpec, conn) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller decides when to stop
    try:
        Worker(spec, conn).run()
    except (EOFError, BrokenPipeError):
        pass  # the controller went away
    except BaseException as exc:  # noqa: BLE001 - reported to the controller, then exit
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            conn.send(("error", spec.rank, f"{detail}\n{traceback.format_exc()}"))
        except OSError:
            pass
        os._exit(1)


class Worker:
    def __init__(self, spec: WorkerSpec, conn):
        self.spec, self.conn = spec, conn
        self._set_roles(spec.layout)
        self.events: list[dict] = []
        self.switcher = None
        self._send_lock = threading.Lock()   # the prefetcher thread reports on the same pipe
        self._last_flush = time.monotonic()
        self._sends: deque = deque()

    def _set_roles(self, layout) -> None:
        """Who this rank is in `layout`: its stage and shard, its neighbours, whether it samples
        (Seesaw fixes the sampling rank across its layouts: the sampler keeps per-request state)."""
        rank = self.spec.rank
        self.layout = layout
        self.info = layout.info(rank)
        self.prev = layout.prev_rank(rank)
        self.next = layout.next_rank(rank)
        self.is_last = self.next is None
        seesaw = self.spec.seesaw
        self.samples = self.is_last and (rank == seesaw.sampling_rank if seesaw is not None
                                         else self.info.tp_rank == 0)

    def send(self, message) -> None:
        with self._send_lock:
            self.conn.send(message)

    # --- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        import torch.distributed as dist

        from ..attention import select_backend
        from ..kv_cache import KVCacheSpec, allocate_kv_tensors
        from ..model.loader import build_model, load_arch
        from ..model.ops import NativeOps
        from ..sampler import Sampler
        from pathlib import Path

        spec, layout = self.spec, self.layout
        torch.set_num_threads(spec.threads)
        if spec.device == "cuda":
            local = spec.rank % max(torch.cuda.device_count(), 1)
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        store = dist.TCPStore("127.0.0.1", spec.store_port, None, False,
                              timeout=datetime.timedelta(seconds=spec.timeout_s))
        dist.init_process_group("nccl" if spec.device == "cuda" else "gloo", store=store,
                                rank=spec.rank, world_size=layout.world_size,
                                timeout=datetime.timedelta(seconds=spec.timeout_s))
        dtype = getattr(torch, spec.dtype)
        arch = load_arch(Path(spec.model_dir), spec.arch_overrides or None)
        self.hidden_size, self.dtype = arch.hidden_size, dtype
        self.backend = select_backend(spec.attention_backend, self.device, dtype)
        if spec.seesaw is not None:
            from batchinfer.resharding.worker_layouts import LayoutSwitcher

            self.switcher = LayoutSwitcher(self, spec.seesaw, arch, self._report_swaps)
            self._enter_layout(spec.seesaw.initial)
        else:
            tp_group = None
            if layout.tp > 1:
                from ..model.shard import TensorParallelGroup

                for ranks in layout.tp_groups():  # every rank creates every group, same order
                    group = dist.new_group(ranks)
                    if spec.rank in ranks:
                        tp_group = TensorParallelGroup(group)
            self.model = build_model(Path(spec.model_dir), arch, dtype, self.device,
                                     spec.max_model_len, self.info.partition, dummy=spec.dummy,
                                     seed=spec.seed, tp_group=tp_group)
            if self.backend.name == "native":
                self.model.use_ops(NativeOps)
            layers = self.model.partition.layer_end - self.model.partition.layer_start
            kv_spec = KVCacheSpec(layers, spec.num_blocks, spec.block_size,
                                  self.model.num_local_kv_heads, arch.head_dim,
                                  torch.tensor([], dtype=dtype).element_size())
            self.kv_caches = allocate_kv_tensors(kv_spec, dtype, self.device)
        layers = self.model.partition.layer_end - self.model.partition.layer_start
        self.sampler = (Sampler(spec.vocab_size, spec.eos_token_ids, self.device, seed=spec.seed,
                                native_kernels=self.backend.name == "native")
                        if self.samples else None)   # Seesaw: the same rank in every layout
        self.mirror: dict = {}   # request id -> Sequence (prompt, params, tokens sampled here)
        self.send(("ready", spec.rank, {"pid": os.getpid(), "layers": layers,
                                             "attention_backend": self.backend.name}))

    # --- loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        self.setup()
        pending: deque = deque()
        with torch.inference_mode():
            while True:
                if not pending or self.conn.poll():
                    message = self.conn.recv()
                    if message[0] == "stop":
                        break
                    if message[0] == "swap":
                        self.switcher.prefetcher.submit(*message[1:])
                        continue
                    if message[0] == "reshard":
                        while pending:       # plans sent before the switch run in the old layout
                            self._execute(*pending.popleft())
                        self._finish_sends()
                        t0 = time.time()
                        self._enter_layout(message[1])
                        stats = self.switcher.last_stats
                        self._event("reshard", -1, t0, layout=message[1],
                                    bytes_from_host=stats.bytes_from_host)
                        self._flush_events(force=True)
                        continue
                    pending.append(self._post_receives(message[1]))
                    continue
                self._execute(*pending.popleft())
                self._flush_events()
        self._finish_sends()
        self._flush_events(force=True)
        if self.switcher is not None:
            self.switcher.prefetcher.close()

    def _enter_layout(self, name: str) -> None:
        from ..model.ops import NativeOps

        layout, self.model, self.kv_caches = self.switcher.enter(name)
        if self.backend.name == "native":
            self.model.use_ops(NativeOps)
        self._set_roles(layout)

    def _report_swaps(self, transfer_ids: list[int], seconds: float) -> None:
        self.send(("swapped", self.spec.rank, transfer_ids, seconds))

    def _post_receives(self, plan):
        import torch.distributed as dist

        if self.prev is None:
            return plan, None, None
        shape = (plan.num_tokens, self.hidden_size)
        hidden = torch.empty(shape, dtype=self.dtype, device=self.device)
        residual = torch.empty(shape, dtype=self.dtype, device=self.device)
        works = [dist.irecv(hidden, src=self.prev, tag=_tag(plan.mb_id, 0)),
                 dist.irecv(residual, src=self.prev, tag=_tag(plan.mb_id, 1))]
        return plan, (hidden, residual), works

    def _execute(self, plan, received, works) -> None:
        import torch.distributed as dist

        from ..step_plan import model_inputs

        hidden = residual = None
        if works is not None:
            t0 = time.time()
            for work in works:
                work.wait()
            self._event("recv", plan.mb_id, t0)
            hidden, residual = received
        t0 = time.time()
        inputs = model_inputs(plan, self.spec.block_size, self.device)
        hidden, residual = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                      inputs.meta, self.backend, hidden, residual)
        if not self.is_last:
            self._event("forward", plan.mb_id, t0, tokens=plan.num_tokens)
            t1 = time.time()
            self._sends.append((plan.mb_id, t1, [
                dist.isend(hidden.contiguous(), dst=self.next, tag=_tag(plan.mb_id, 0)),
                dist.isend(residual.contiguous(), dst=self.next, tag=_tag(plan.mb_id, 1))],
                (hidden, residual)))
            self._reap_sends()
            return
        self._forget(plan.released)
        tokens, logprobs = [], []
        forward_s = time.time() - t0
        t1 = time.time()
        if plan.sample_items:
            rows = inputs.logits_rows
            logits = self.model.compute_logits(hidden[rows], residual[rows] if residual is not None
                                               else None)
            if self.samples:
                tokens, logprobs = self._sample(plan, logits)
        self._event("forward", plan.mb_id, t0, tokens=plan.num_tokens)
        if self.samples:
            self.send(("result", self.info.replica, {
                "mb_id": plan.mb_id, "tokens": tokens, "logprobs": logprobs,
                "forward_s": forward_s, "sample_s": time.time() - t1,
                "events": self._take_events()}))

    def _sample(self, plan, logits):
        from ..executor import _row_logprobs
        from ..request import Sequence

        for request in plan.new_requests:
            self.mirror[request.request_id] = Sequence(request=request)
        seqs = []
        for rid, n_out in zip(plan.sample_request_ids, plan.sample_output_lens):
            seq = self.mirror[rid]
            if len(seq.output_token_ids) > n_out:   # the controller trimmed (never grows here)
                del seq.output_token_ids[n_out:]
            seqs.append(seq)
        sampled, info = self.sampler.sample(logits, self.sampler.prepare(seqs))
        tokens = sampled.tolist()
        logprobs = [None] * len(tokens)
        for row, (seq, token) in enumerate(zip(seqs, tokens)):
            seq.output_token_ids.append(token)
            top_n = seq.request.sampling.logprobs
            if info is not None and top_n is not None:
                logprobs[row] = _row_logprobs(info, row, top_n)
        return tokens, logprobs

    def _forget(self, request_ids) -> None:
        for rid in request_ids:
            self.mirror.pop(rid, None)
            if self.sampler is not None:
                self.sampler.release(rid)

    # --- sends and timeline ---------------------------------------------------------------------
    def _reap_sends(self) -> None:
        while self._sends and (len(self._sends) > MAX_PENDING_SENDS
                               or all(w.is_completed() for w in self._sends[0][2])):
            mb_id, t0, works, _keep = self._sends.popleft()
            for work in works:
                work.wait()
            self._event("send", mb_id, t0)

    def _finish_sends(self) -> None:
        while self._sends:
            mb_id, t0, works, _keep = self._sends.popleft()
            for work in works:
                try:
                    work.wait()
                except RuntimeError:
                    pass

    def _event(self, kind: str, mb_id: int, start: float, **extra) -> None:
        self.events.append({"rank": self.spec.rank, "replica": self.info.replica,
                            "stage": self.info.stage, "tp_rank": self.info.tp_rank,
                            "kind": kind, "mb": mb_id, "start": start, "end": time.time(), **extra})

    def _take_events(self) -> list[dict]:
        events, self.events = self.events, []
        self._last_flush = time.monotonic()
        return events

    def _flush_events(self, force: bool = False) -> None:
        if self.events and (force or time.monotonic() - self._last_flush >= EVENT_FLUSH_S):
            self.send(("events", self.spec.rank, self._take_events()))


def _tag(mb_id: int, which: int) -> int:
    return (mb_id % (1 << 20)) * 2 + which
