"""A worker process: one rank's model partition and KV cache, executing micro-batch plans.

The loop, per plan (plans arrive in pipeline order on the control pipe):
- stages after the first post their receives for (hidden, residual) as soon as the plan arrives
  (stage_transport.py: after the first transfer the shape is the plan's token count x the hidden
  size the first transfer carried, so no metadata travels with the tensors);
- prepare the model inputs (inline, or with token-safe execution one plan ahead on a
  thread: input_prep.py);
- run the partition's layers; the tensor-parallel all-reduces happen inside the model;
- send (hidden, residual) on to the next stage, or, on the last stage, compute the logits of the
  rows that sample and (TP rank 0) sample them and send the tokens to the controller, or hand
  the rows to the consumer a strategy's extension installed (`logits_out`).
A strategy that works below the scheduler plugs in through a WorkerExtension
(worker_extension.py): the worker calls its hooks and names no strategy.
Every forward, input preparation, receive and send is recorded (wall clock) for the timeline.
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
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import envs
from ..errors import ConfigError
from ..kv_swap import SwapArea
from ..step_plan import ModelInputs
from .input_prep import TokenSafeInputs, VersionedInputs
from .plan_deltas import TableCache
from . import transport
from .stage_transport import StageReceiver, StageSender
from .worker_extension import WorkerExtension

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
    kv_dtype: str               # the KV cache's torch dtype name (cache.kv_cache_dtype)
    device: str                 # cpu | cuda
    max_model_len: int
    num_blocks: int
    block_size: int
    threads: int
    bind_threads: str           # device.bind_threads: auto | none
    attention_backend: str
    vocab_size: int
    eos_token_ids: tuple
    timeout_s: float
    store_port: int = 0
    extension: Optional[WorkerExtension] = None  # a strategy's worker-level mechanism
    tp_buffers: dict = field(default_factory=dict)  # TP group's ranks -> shared all-reduce buffer
    kv_groups: Optional[object] = None  # kv_groups.KVGroupLayout: a table per layer group
    quantization: Optional[object] = None  # int8_linear.LinearQuantization (model.quantization)
    triton_experts: bool = False  # a mixture of experts on CUDA: triton_moe's grouped kernels
    swap_blocks: int = 0        # the swap area's blocks (memory.preemption_mode: swap)
    staged_transport: bool = False  # parallel.gpu_transport: host (transport.py; on a CPU
                                    # device, tests only: every tensor through a host copy)
    decode_graphs: Optional[object] = None  # worker_graphs.WorkerGraphSpec: two graphs per size
    tokenizer_source: Optional[str] = None  # the tokenizer's directory (structured_outputs)
    lora: Optional[object] = None  # model/lora_adapters.LoraSpec: the adapters its layers apply


PROCESS_NAME_PREFIX = "batchinfer-r"   # + rank: what ps, top and /proc/PID/comm show


def _die_with_parent_and_name(name: str) -> None:
    """Linux: the kernel kills this worker if its parent dies (the fork server, which exits
    with the controller: so even a kill -9 of the controller ends it), and the process gets a
    name that tells the ranks (and helper processes) apart in ps and top."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)                                         # PR_SET_PDEATHSIG
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]))                  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def worker_main(spec: WorkerSpec, conn) -> None:
    run_child(spec.rank, conn, lambda: Worker(spec, conn).run())


def run_child(rank: int, conn, body, name: str = "") -> None:
    """A spawned process's frame: dies with the controller, leaves SIGINT / SIGTERM to it, and
    reports any exception (with its traceback) on the control pipe before exiting. `name`: what
    ps shows (default: batchinfer-r<rank>)."""
    _die_with_parent_and_name(name or f"{PROCESS_NAME_PREFIX}{rank}")
    # the controller decides when to stop: Ctrl-C and Slurm's SIGTERM reach the whole process
    # group, and a worker that died of them would turn a clean stop into a failed run
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)     # the driver stops the job (runner/stop_signals.py)
    try:
        body()
    except (EOFError, BrokenPipeError):
        pass  # the controller went away
    except BaseException as exc:  # noqa: BLE001 - reported to the controller, then exit
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            conn.send(("error", rank, f"{detail}\n{traceback.format_exc()}"))
        except OSError:
            pass
        os._exit(1)


class Worker:
    def __init__(self, spec: WorkerSpec, conn):
        self.spec, self.conn = spec, conn
        self.ext = spec.extension if spec.extension is not None else WorkerExtension()
        self.set_roles(spec.layout)
        self.events: list[dict] = []
        self.inputs = None                   # token-safe input preparation, one plan ahead
        self.graphs = None                   # decode graphs per input version (worker_graphs.py)
        self.swap_area = SwapArea(spec.swap_blocks)   # host copies of KV blocks (kv_swap.py)
        self.sender = self.receiver = None
        self._send_lock = threading.Lock()   # the prefetcher thread reports on the same pipe
        self._events_lock = threading.Lock()  # the input thread records events too
        self._last_flush = time.monotonic()
        # read here, in the worker: the fork server imported this module with its own environment
        self._flush_s = float(envs.get("BATCHINFER_EVENT_FLUSH_S"))
        self._sends: deque = deque()
        self.tables = TableCache()           # the replica's block tables (plan_deltas.py)

    def set_roles(self, layout) -> None:
        """Who this rank is in `layout`: its stage and shard, its neighbours, whether it samples
        (TP rank 0 of the last stage, unless the extension says otherwise)."""
        rank = self.spec.rank
        self.layout = layout
        self.info = layout.info(rank)
        self.prev = layout.prev_rank(rank)
        self.next = layout.next_rank(rank)
        self.is_last = self.next is None
        self.logits_out = None               # an extension's consumer of the last stage's rows
        self.samples = self.is_last and self.info.tp_rank == 0
        self.ext.roles(self)

    def open_channels(self) -> None:
        """The transports to the neighbour stages of the current layout (new ones per layout)."""
        aware = self.ext.structure_aware
        self.receiver = (StageReceiver(self.prev, self.device, aware)
                         if self.prev is not None else None)
        self.sender = StageSender(self.next, self.device, aware) if self.next is not None else None

    def send(self, message) -> None:
        with self._send_lock:
            self.conn.send(message)

    # --- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        import torch.distributed as dist

        from ..attention import select_backend
        from ..kv_cache import KVCacheSpec, allocate_kv_tensors
        from ..model.loader import build_model, load_arch
        from ..sampler import Sampler
        from pathlib import Path

        spec, layout = self.spec, self.layout
        ready_extra: dict = {}
        if spec.device == "cuda":
            torch.set_num_threads(spec.threads)
            local = spec.rank % max(torch.cuda.device_count(), 1)
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            from ..cpu_binding import bind_compute_threads

            bind_compute_threads(spec.bind_threads, spec.threads, slot=spec.rank,
                                 slots=layout.world_size)
            self.device = torch.device("cpu")
        store = dist.TCPStore("127.0.0.1", spec.store_port, None, False,
                              timeout=datetime.timedelta(seconds=spec.timeout_s))
        transport.configure(spec.staged_transport, stage_cpu_tensors=spec.device == "cpu")
        dist.init_process_group(transport.backend(spec.device, spec.staged_transport), store=store,
                                rank=spec.rank, world_size=layout.world_size,
                                timeout=datetime.timedelta(seconds=spec.timeout_s))
        dtype = getattr(torch, spec.dtype)
        arch = load_arch(Path(spec.model_dir), spec.arch_overrides or None)
        self.dtype = dtype                   # an extension that builds its own partitions uses it
        self.kv_dtype = getattr(torch, spec.kv_dtype)  # ... and its KV buffer in this
        self.backend = select_backend(spec.attention_backend, self.device, dtype, arch,
                                      self.kv_dtype)
        if self.ext.build_partition(self, arch):
            if spec.lora is not None:
                raise ConfigError("model.lora_modules: this strategy builds its own model "
                                  "partitions, which do not apply LoRA adapters")
            ready_extra.update(self.ext.setup(self))
        else:
            tp_group = None
            if layout.tp > 1:
                from .shm_allreduce import tensor_parallel_group

                for ranks in layout.tp_groups():  # every rank creates every group, same order
                    group = dist.new_group(ranks)
                    if spec.rank in ranks:
                        tp_group = tensor_parallel_group(group, ranks, spec)
            self.model = build_model(Path(spec.model_dir), arch, dtype, self.device,
                                     spec.max_model_len, self.info.partition, dummy=spec.dummy,
                                     seed=spec.seed, tp_group=tp_group,
                                     pack=self.ext.pack_linears,
                                     quantization=spec.quantization, lora=spec.lora)
            self.use_fused_ops()
            ready_extra.update(self.ext.setup(self))   # before the KV cache takes its memory
            start, end = self.model.partition.layer_start, self.model.partition.layer_end
            groups = spec.kv_groups          # with layer groups: the page slots its layers use
            # with decode graphs one block past the scheduler's pool takes the padding rows' K/V
            kv_spec = KVCacheSpec(len(groups.slots_of(start, end)) if groups else end - start,
                                  spec.num_blocks + (spec.decode_graphs is not None),
                                  spec.block_size,
                                  self.model.num_local_kv_heads, arch.head_dim,
                                  self.kv_dtype.itemsize)
            self.kv_caches = allocate_kv_tensors(kv_spec, self.kv_dtype, self.device)
            if groups is not None:
                self.kv_caches = groups.layer_caches(self.kv_caches, start, end)
                self.model.use_kv_groups(groups)
        self.open_channels()
        if self.ext.token_safe_inputs:
            prepare = VersionedInputs(spec.block_size, self.device).fill
            if spec.decode_graphs is not None:
                prepare = self._graphed(prepare)
            self.inputs = TokenSafeInputs(prepare, self._prepared)
        ready_extra["decode_graphs"] = self.graphs is not None
        layers = self.model.partition.layer_end - self.model.partition.layer_start
        self.sampler = (Sampler(spec.vocab_size, spec.eos_token_ids, self.device, seed=spec.seed,
                                native_kernels=self.backend.name == "native",
                                tokenizer_source=spec.tokenizer_source)
                        if self.samples else None)   # one rank keeps sampling across layouts
        self.mirror: dict = {}   # request id -> Sequence (prompt, params, tokens sampled here)
        self.send(("ready", spec.rank, {"pid": os.getpid(), "layers": layers,
                                        "attention_backend": self.backend.name, **ready_extra}))

    def _graphed(self, eager):
        """Token-safe preparation through two decode graphs per batch size (worker_graphs.py),
        captured now (the controller asks for them only with the Triton attention:
        runtime/build.decode_graph_spec)."""
        from .worker_graphs import WorkerGraphs

        spec = self.spec
        triton = self.backend.name == "triton"
        groups = spec.kv_groups.num_groups if spec.kv_groups is not None else 1
        self.graphs = WorkerGraphs(spec.decode_graphs, self.model, self.kv_caches, self.device,
                                   spec.block_size, groups, spec.num_blocks, triton)
        self.graphs.capture_all()
        return self.graphs.preparer(eager)

    def use_fused_ops(self) -> None:
        """The backend's fused ops (native or Triton) and, where the spec says, the Triton
        experts for the current model (after every model build)."""
        from ..attention import fused_ops_for

        ops = fused_ops_for(self.backend.name)
        if ops is not None:
            self.model.use_ops(ops)
        if self.spec.triton_experts:
            from ..model.fused_experts import use_triton_experts

            use_triton_experts(self.model)

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
                    if message[0] == "plan":
                        pending.append(self._post_receives(self.tables.apply(message[1])))
                    elif not self.ext.message(self, message, pending):
                        raise RuntimeError(f"rank {self.spec.rank}: unknown control message "
                                           f"{message[0]!r}")
                    continue
                self.execute(*pending.popleft())
                self.flush_events()
        if self.inputs is not None:
            self.inputs.close()
        self.ext.close(self)
        self.finish_sends()
        self.flush_events(force=True)

    def _post_receives(self, plan):
        if self.inputs is not None:
            self.inputs.submit(plan)
        received = (self.receiver.post(plan.mb_id, plan.num_tokens)
                    if self.receiver is not None else None)
        return plan, received

    def _prepared(self, plan, start: float, end: float) -> None:
        self.event("prepare", plan.mb_id, start, end=end)

    def _model_inputs(self, plan):
        from ..step_plan import model_inputs

        if self.inputs is None:
            t0 = time.time()
            inputs = model_inputs(plan, self.spec.block_size, self.device)
            self.event("prepare", plan.mb_id, t0)
            return inputs
        taken, inputs = self.inputs.take(self.spec.timeout_s)
        if taken.mb_id != plan.mb_id:
            raise RuntimeError(f"prepared inputs of micro-batch {taken.mb_id} reached the forward "
                               f"of {plan.mb_id}")
        return inputs

    def execute(self, plan, received) -> None:
        self.swap_area.run(plan.kv_swaps, self.kv_caches)   # this rank's layers and heads
        if not self.ext.execute(self, plan, received):
            self.execute_plain(plan, received)

    def execute_plain(self, plan, received) -> None:
        hidden = residual = None
        if received is not None:
            t0 = time.time()
            tensors = received.wait()
            self.event("recv", plan.mb_id, t0)
            hidden, residual = tensors["hidden"], tensors["residual"]
        inputs = self._model_inputs(plan)
        t0 = time.time()
        graphed = {}
        if self.graphs is not None and not isinstance(inputs, ModelInputs):
            hidden, residual = self.graphs.forward(inputs)      # a staged decode graph
            graphed = {"graph": inputs.version}                 # on the forward's event
        else:
            hidden, residual = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                          inputs.meta, self.backend, hidden, residual)
        if not self.is_last:
            self.event("forward", plan.mb_id, t0, tokens=plan.num_tokens, **graphed)
            self._send_expert_load(plan.mb_id)     # before the hidden states: ahead of the result
            t1 = time.time()
            works = self.sender.send(plan.mb_id, {"hidden": hidden, "residual": residual})
            self._sends.append((plan.mb_id, t1, works))
            self._reap_sends()
            return
        scores = self._score_prompts(plan, hidden, residual) if plan.prompt_scores else None
        if self.logits_out is not None:    # sampler processes send the result
            forward_s = time.time() - t0
            self._send_expert_load(plan.mb_id)
            if scores is not None:         # ahead of the samplers' result, as expert loads
                self.send(("prompt_logprobs", self.info.replica, plan.mb_id, scores))
            self.logits_out.publish(self.model, plan, hidden, residual, inputs.logits_rows,
                                    forward_s)
            self.event("forward", plan.mb_id, t0, tokens=plan.num_tokens, **graphed)
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
        self.event("forward", plan.mb_id, t0, tokens=plan.num_tokens, **graphed)
        if self.samples:
            result = {"mb_id": plan.mb_id, "tokens": tokens, "logprobs": logprobs,
                      "forward_s": forward_s, "sample_s": time.time() - t1,
                      "events": self._take_events()}
            if scores is not None:
                result["prompt_logprobs"] = scores
            stats = self.ext.result_stats(self)     # e.g. shared-weight counters ride along
            if stats is not None:
                result["stats"] = stats
            load = self.model.take_expert_load()    # a mixture of experts: this stage's layers
            if load is not None:
                result["expert_load"] = load
            self.send(("result", self.info.replica, result))

    def _score_prompts(self, plan, hidden, residual) -> Optional[dict]:
        """The plan's prompt positions scored on the last stage (prompt_logprobs.py): every TP
        rank runs the LM head (its all-gather), TP rank 0 keeps the scores."""
        from ..prompt_logprobs import score_slices

        return score_slices(self.model, hidden, residual, plan.prompt_scores,
                            keep=self.info.tp_rank == 0)

    def _send_expert_load(self, mb_id: int) -> None:
        """A mixture of experts on a rank that does not send the result (a stage before the
        last, or the last when sampler processes answer): its layers' tokens per expert go to
        the controller ahead of its outputs, and the controller joins them to the micro-batch's
        result (one TP rank sends: every rank routes the same tokens)."""
        load = self.model.take_expert_load() if self.info.tp_rank == 0 else None
        if load is not None:
            self.send(("expert_load", self.info.replica, mb_id, self.info.stage, load))

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
            mb_id, t0, works = self._sends.popleft()
            for work in works:
                work.wait()
            self.event("send", mb_id, t0)

    def finish_sends(self) -> None:
        while self._sends:
            mb_id, t0, works = self._sends.popleft()
            for work in works:
                try:
                    work.wait()
                except RuntimeError:
                    pass

    def event(self, kind: str, mb_id: int, start: float, end: Optional[float] = None,
               **extra) -> None:
        event = {"rank": self.spec.rank, "replica": self.info.replica, "stage": self.info.stage,
                 "tp_rank": self.info.tp_rank, "kind": kind, "mb": mb_id, "start": start,
                 "end": time.time() if end is None else end, **extra}
        with self._events_lock:
            self.events.append(event)

    def _take_events(self) -> list[dict]:
        with self._events_lock:
            events, self.events = self.events, []
        self._last_flush = time.monotonic()
        return events

    def flush_events(self, force: bool = False) -> None:
        if self.events and (force or time.monotonic() - self._last_flush >= self._flush_s):
            self.send(("events", self.spec.rank, self._take_events()))
