"""The Executor seam: where a micro-batch runs. This is the in-process one.

An executor takes MicroBatches (sequences and how many of their tokens to compute), runs the
model over them against the paged KV cache, samples where a sequence reached its last known token
and hands back those tokens. `submit` starts a micro-batch, `collect` returns the next finished
one: the in-process executor runs it inside `submit` (one in flight); the multi-process one
(engine/runtime/) keeps up to `max_in_flight` micro-batches in its pipeline.

Optional, for a scheduler that moves KV between tiers or switches layouts (Seesaw's
resharding/executor.py): `run_actions(actions)` carries out what the scheduler's `take_actions()`
decided, `num_pending_transfers` / `transfers_ready()` / `take_done_transfers()` report the copies,
which the engine hands to the scheduler's `on_transfers_done()`.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from .attention import AttentionBackend
from .cuda_graphs import DecodeGraphs
from .kv_cache import BlockManager
from .model.llama import CausalLM
from .sampler import Sampler
from .scheduler import MicroBatch
from .step_plan import model_inputs, plan_batch


@dataclass
class StepResult:
    """Sampled tokens for the batch items that sample, in batch order (None for the others)."""

    tokens: list[Optional[int]]
    logprobs: list[Optional[dict]]
    forward_s: float = 0.0
    sample_s: float = 0.0
    events: list[dict] = field(default_factory=list)


class Executor(Protocol):
    max_in_flight: int

    @property
    def num_in_flight(self) -> int: ...
    def submit(self, batch: MicroBatch) -> None: ...
    def collect(self) -> tuple[MicroBatch, StepResult]: ...
    def ready(self) -> bool: ...
    def wait(self) -> None: ...
    def release(self, request_id: str) -> None: ...
    def close(self) -> None: ...


def sample_tokens(model: CausalLM, sampler: Sampler, hidden: torch.Tensor,
                  residual: Optional[torch.Tensor], rows: torch.Tensor, seqs: list):
    """Final norm + LM head on the rows that sample (`rows` of hidden), then the sampler.
    -> (token per row, logprob dict or None per row)."""
    logits = model.compute_logits(hidden[rows], None if residual is None else residual[rows])
    sampled, info = sampler.sample(logits, sampler.prepare(seqs))
    tokens = sampled.tolist()
    logprobs: list[Optional[dict]] = [None] * len(tokens)
    if info is not None:
        for row, seq in enumerate(seqs):
            if seq.request.sampling.logprobs is not None:
                logprobs[row] = _row_logprobs(info, row, seq.request.sampling.logprobs)
    return tokens, logprobs


class InProcessExecutor:
    """Runs the whole model in this process (single device)."""

    max_in_flight = 1

    def __init__(self, model: CausalLM, kv_caches: list, backend: AttentionBackend,
                 sampler: Sampler, block_manager: BlockManager, device: torch.device,
                 graphs: Optional[DecodeGraphs] = None):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.sampler, self.block_manager, self.device = sampler, block_manager, device
        self.graphs = graphs      # CUDA graphs for pure-decode steps (engine/cuda_graphs.py)
        self._done: deque[tuple[MicroBatch, StepResult]] = deque()

    @property
    def num_in_flight(self) -> int:
        return len(self._done)

    def submit(self, batch: MicroBatch) -> None:
        self._done.append((batch, self.execute(batch)))

    def collect(self) -> tuple[MicroBatch, StepResult]:
        return self._done.popleft()

    def ready(self) -> bool:
        return bool(self._done)

    def wait(self) -> None:
        """Nothing to wait for: submit already ran the micro-batch."""

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    def close(self) -> None:
        self._done.clear()

    @torch.inference_mode()
    def execute(self, batch: MicroBatch) -> StepResult:
        t0 = time.perf_counter()
        plan = plan_batch(batch, self.block_manager)
        graphed = self.graphs.run(plan) if self.graphs is not None else None
        if graphed is not None:
            hidden, residual, rows = graphed
        else:
            inputs = model_inputs(plan, self.block_manager.block_size, self.device)
            hidden, residual = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                          inputs.meta, self.backend)
            rows = inputs.logits_rows
        tokens: list[Optional[int]] = [None] * len(batch.items)
        logprobs: list[Optional[dict]] = [None] * len(batch.items)
        t1 = time.perf_counter()
        if plan.sample_items:
            seqs = [batch.items[i].seq for i in plan.sample_items]
            sampled, row_logprobs = sample_tokens(self.model, self.sampler, hidden, residual,
                                                  rows, seqs)
            for index, token, logprob in zip(plan.sample_items, sampled, row_logprobs):
                tokens[index], logprobs[index] = token, logprob
        t2 = time.perf_counter()
        return StepResult(tokens, logprobs, forward_s=t1 - t0, sample_s=t2 - t1)


def _row_logprobs(info: dict, row: int, top_n: int) -> dict:
    out = {"logprob": float(info["sampled"][row]), "top": []}
    if top_n > 0 and info["top_ids"] is not None:
        ids = info["top_ids"][row, :top_n].tolist()
        values = info["top_values"][row, :top_n].tolist()
        out["top"] = list(zip(ids, values))
    return out
