"""Token-safe execution (arXiv:2506.22033 §5.2, Fig. 6): a worker's input preparation runs on its own
thread, one iteration ahead of the forward, writing into one of two versioned input buffers while
the forward reads the other.

Two finite-state machines share a CPU indicator CI and a GPU indicator GI (the latest iteration
each has taken up; both start at -1):
- the CPU executor runs (prepares iteration CI + 1 into buffer version (CI + 1) % 2) only when
  CI == GI, i.e. the forward has taken every input prepared so far; it then queues a descriptor
  and increments CI;
- the GPU executor raises GI as soon as it takes an input up (before running it), which lets the
  CPU prepare the next iteration into the other version.
So when the CPU writes version v for iteration i + 1, the forward has started iteration i (the
other version) and has finished iteration i - 1 (the forward loop is sequential; on CUDA the
copies into the buffers are stream-ordered after it): a buffer is never overwritten while read.
On CUDA the paper binds two captured graphs per batch size to the two versions: so does a
worker that holds the whole model on CUDA (worker_graphs.py: a pure-decode plan is staged into
its version's graph inputs); other steps, and other workers, read views of the version's
buffers in an eager forward.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Optional

import torch

from ..attention import GROUP_DTYPES, METADATA_DTYPES, AttentionMetadata
from ..cpu_binding import release_helper_thread
from ..model.lora import lora_step
from ..step_plan import INPUT_DTYPES, ModelInputs, StepPlan, flatten_groups, input_lists


class VersionedInputs:
    """Two physical versions of every model-input tensor, grown (never shrunk) on demand."""

    def __init__(self, block_size: int, device: torch.device, tokens: int = 256, seqs: int = 64,
                 blocks: int = 16):
        self.block_size, self.device = block_size, device
        self.versions = [self._allocate(tokens, seqs, blocks) for _ in range(2)]

    def _allocate(self, tokens: int, seqs: int, blocks: int) -> dict:
        # block_tables is flat, so a [seqs, width] view of its head is contiguous at any width
        sizes = {"input_ids": tokens, "positions": tokens, "slot_blocks": tokens,
                 "slot_offsets": tokens, "query_start": seqs + 1, "seq_lens": seqs,
                 "logits_rows": seqs, "block_tables": seqs * blocks}
        return {name: torch.zeros(sizes[name], dtype=dtype, device=self.device)
                for name, dtype in INPUT_DTYPES.items()}

    def fill(self, version: int, plan: StepPlan) -> ModelInputs:
        """Writes `plan`'s inputs (step_plan.input_lists, as model_inputs has them) into buffer
        `version`; -> views of it."""
        lists = input_lists(plan, self.block_size)
        groups = {name: lists.pop(name) for name in GROUP_DTYPES if name in lists}
        tables = lists.pop("block_tables")
        n_seq, width = len(tables), len(tables[0]) if tables else 1
        buf = self.versions[version]
        if (len(lists["input_ids"]) > buf["input_ids"].numel()
                or n_seq > buf["seq_lens"].numel() or n_seq * width > buf["block_tables"].numel()):
            seqs = max(n_seq, buf["seq_lens"].numel())
            buf = self.versions[version] = self._allocate(
                max(len(lists["input_ids"]), buf["input_ids"].numel()), seqs,
                max(width, -(-buf["block_tables"].numel() // seqs)))
        views = {}
        for name, data in lists.items():
            views[name] = buf[name][:len(data)]
            views[name].copy_(torch.tensor(data, dtype=INPUT_DTYPES[name]), non_blocking=True)
        views["block_tables"] = buf["block_tables"][:n_seq * width].view(n_seq, width)
        views["block_tables"].copy_(torch.tensor(tables, dtype=torch.int32).view(n_seq, width),
                                    non_blocking=True)
        meta = AttentionMetadata(**{name: views[name] for name in METADATA_DTYPES},
                                 query_lens_cpu=list(plan.query_lens),
                                 seq_lens_cpu=list(plan.seq_lens))
        if groups:    # KV layer groups: fresh tensors, never overwritten while a forward reads
            flat = flatten_groups(groups)
            meta.with_groups(
                torch.tensor(flat["group_block_tables"], dtype=torch.int32).view(
                    len(plan.group_tables), n_seq, width).to(self.device, non_blocking=True),
                torch.tensor(flat["group_slot_blocks"], dtype=torch.int64).view(
                    len(plan.group_tables), -1).to(self.device, non_blocking=True))
        meta.lora = lora_step(plan.lora_slots, plan.query_lens, self.device)   # fresh tensors
        return ModelInputs(views["input_ids"], views["positions"], meta, views["logits_rows"])


class TokenSafeInputs:
    """The CPU executor (a thread) and the GPU executor's side of the handshake (`take`)."""

    def __init__(self, prepare: Callable[[int, StepPlan], ModelInputs],
                 on_prepared: Optional[Callable[[StepPlan, float, float], None]] = None):
        self._prepare, self._on_prepared = prepare, on_prepared
        self.ci = -1                       # CPU indicator: latest iteration prepared
        self.gi = -1                       # GPU indicator: latest iteration taken up
        self._cond = threading.Condition()
        self._schedules: deque = deque()   # scheduling outputs (plans) not yet prepared
        self._inputs: deque = deque()      # (iteration, plan, inputs) ready for the forward
        self._closed = False
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._cpu_executor, name="batchinfer-inputs",
                                        daemon=True)
        self._thread.start()

    def submit(self, plan: StepPlan) -> None:
        with self._cond:
            self._schedules.append(plan)
            self._cond.notify_all()

    def take(self, timeout_s: float) -> tuple[StepPlan, ModelInputs]:
        """The GPU executor: W -> R when an input is ready; GI is raised on entering R."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._inputs:
                if self._error is not None:
                    raise RuntimeError(f"input preparation failed: {self._error}") from self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no prepared input within {timeout_s:.0f} s")
                self._cond.wait(left)
            iteration, plan, inputs = self._inputs.popleft()
            self.gi = iteration
            self._cond.notify_all()
        return plan, inputs

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5.0)

    def _cpu_executor(self) -> None:
        release_helper_thread()
        while True:
            with self._cond:
                while not self._closed and not (self._schedules and self.ci == self.gi):
                    self._cond.wait()
                if self._closed:
                    return
                plan = self._schedules.popleft()
                iteration = self.ci + 1
            start = time.time()
            try:
                with torch.inference_mode():
                    inputs = self._prepare(iteration % 2, plan)
            except BaseException as exc:  # noqa: BLE001 - surfaced to the forward loop in take()
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            if self._on_prepared is not None:
                self._on_prepared(plan, start, time.time())
            with self._cond:
                self._inputs.append((iteration, plan, inputs))
                self.ci = iteration
                self._cond.notify_all()
