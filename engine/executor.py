"""The Executor seam: where a micro-batch runs. This is the in-process one.

An executor takes MicroBatches (sequences and how many of their tokens to compute), runs the
model over them against the paged KV cache, samples where a sequence reached its last known token
and hands back those tokens. `submit` starts a micro-batch, `collect` returns the next finished
one: the in-process executor runs it inside `submit` (one in flight); the multi-process one
(engine/runtime/) keeps up to `max_in_flight` micro-batches in its pipeline.

The Executor base class declares every capability the engine calls; its defaults mean "none"
(no timeline, no KV copies, nothing to flush), so the engine never asks which executor it holds.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from .attention import AttentionBackend
from .cuda_graphs import DecodeGraphs
from .kv_cache import BlockManager
from .kv_swap import SwapArea
from .model.causal_lm import CausalLM
from .prompt_logprobs import score_slices
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
    # tokens routed to each expert in each sparse layer the step ran ([layer][expert]; None:
    # a dense model); with PP on worker processes, the last stage's layers
    expert_load: Optional[dict[int, list[int]]] = None   # decoder layer -> tokens per expert
    # batch item -> its scored prompt positions (prompt_logprobs.score_slices); None: none
    prompt_logprobs: Optional[dict[int, dict]] = None


class Executor:
    """The Executor seam: where micro-batches run. Subclasses implement the first block."""

    max_in_flight: int = 1

    @property
    def num_in_flight(self) -> int:
        raise NotImplementedError

    def submit(self, batch: MicroBatch) -> None:
        raise NotImplementedError

    def collect(self) -> tuple[MicroBatch, StepResult]:
        """The next finished micro-batch and its sampled tokens (only when ready())."""
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def wait(self) -> None:
        """Block until something may have finished (a result, a copy)."""
        raise NotImplementedError

    def release(self, request_id: str) -> None:
        """The request finished: drop what the executor keeps for it."""

    # close() stops what the executor runs on (worker processes): nothing runs after it. An
    # in-process executor's close only drops transient state, and its engine goes on.
    stops_on_close = False

    def close(self) -> None:
        pass

    # --- what the report shows -------------------------------------------------------------------
    def step_stats(self) -> dict:
        """Values of the last collected micro-batch for its step event (e.g. the mode it ran in)."""
        return {}

    def strategy_summary(self) -> dict:
        return {}

    def pipeline_summary(self) -> Optional[dict]:
        """Per-rank busy time and bubbles (multi-process executors); None: not measured."""
        return None

    def timeline(self, last: Optional[int] = None) -> list[dict]:
        """Per-rank forward / send / receive intervals, oldest first; `last`: the most recent."""
        return []

    def keep_timeline(self, max_events: int) -> None:
        """Holds up to `max_events` of the timeline's newest events (executors that keep one)."""

    # --- scheduler actions (KV copies between tiers, layout switches) --------------------------
    def run_actions(self, actions: list) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot carry out scheduler actions "
                                  f"({type(actions[0]).__name__})")

    @property
    def num_pending_transfers(self) -> int:
        return 0

    def transfers_ready(self) -> bool:
        return False

    def take_done_transfers(self) -> list:
        return []

    def flush_submissions(self) -> None:
        """Every replica has been offered work this step (an executor that sends the replicas'
        micro-batches together hears it here)."""


def sample_tokens(model: CausalLM, sampler: Sampler, hidden: torch.Tensor,
                  residual: Optional[torch.Tensor], rows: torch.Tensor, seqs: list):
    """Final norm + LM head on the rows that sample (`rows` of hidden), then the sampler.
    -> (token per row, logprob dict or None per row)."""
    logits = model.compute_logits(hidden[rows], None if residual is None else residual[rows])
    sampled, info = sampler.sample(logits, sampler.prepare(seqs))
    tokens = sampled.tolist()
    logprobs: list[Optional[dict]] = [None] * len(tokens)
    if info is not None:       # on the host once, not a blocking copy per row and value
        info = {name: None if t is None else t.cpu() for name, t in info.items()}
        for row, seq in enumerate(seqs):
            if seq.request.sampling.logprobs is not None:
                logprobs[row] = _row_logprobs(info, row, seq.request.sampling.logprobs)
    return tokens, logprobs


class InProcessExecutor(Executor):
    """Runs the whole model in this process (single device)."""

    max_in_flight = 1

    def __init__(self, model: CausalLM, kv_caches: list, backend: AttentionBackend,
                 sampler: Sampler, block_manager: BlockManager, device: torch.device,
                 graphs: Optional[DecodeGraphs] = None):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.sampler, self.block_manager, self.device = sampler, block_manager, device
        self.graphs = graphs      # CUDA graphs for pure-decode steps (engine/cuda_graphs.py)
        self._done: deque[tuple[MicroBatch, StepResult]] = deque()
        self.swap_area = SwapArea()  # host copies of the cache's blocks (kv_swap.py)

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
        self.swap_area.run(plan.kv_swaps, self.kv_caches)
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
        prompt_logprobs = (score_slices(self.model, hidden, residual, plan.prompt_scores)
                           if plan.prompt_scores else None)
        if plan.sample_items:
            seqs = [batch.items[i].seq for i in plan.sample_items]
            sampled, row_logprobs = sample_tokens(self.model, self.sampler, hidden, residual,
                                                  rows, seqs)
            for index, token, logprob in zip(plan.sample_items, sampled, row_logprobs):
                tokens[index], logprobs[index] = token, logprob
        t2 = time.perf_counter()
        return StepResult(tokens, logprobs, forward_s=t1 - t0, sample_s=t2 - t1,
                          expert_load=self.model.take_expert_load(),
                          prompt_logprobs=prompt_logprobs)


def _row_logprobs(info: dict, row: int, top_n: int) -> dict:
    out = {"logprob": float(info["sampled"][row]), "top": []}
    if top_n > 0 and info["top_ids"] is not None:
        ids = info["top_ids"][row, :top_n].tolist()
        values = info["top_values"][row, :top_n].tolist()
        out["top"] = list(zip(ids, values))
    return out
