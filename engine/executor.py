"""The Executor seam: where a micro-batch runs. This is the in-process one.

An executor takes a MicroBatch (sequences and how many of their tokens to compute), runs the model
over them against the paged KV cache, samples where a sequence reached its last known token and
returns those tokens. Multi-process and simulated executors implement the same `execute`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from .attention import AttentionBackend, AttentionMetadata
from .kv_cache import BlockManager
from .model.llama import CausalLM
from .sampler import Sampler
from .scheduler import MicroBatch


@dataclass
class StepResult:
    """Sampled tokens for the batch items that sample, in batch order (None for the others)."""

    tokens: list[Optional[int]]
    logprobs: list[Optional[dict]]
    forward_s: float = 0.0
    sample_s: float = 0.0
    events: list[dict] = field(default_factory=list)


class Executor(Protocol):
    def execute(self, batch: MicroBatch) -> StepResult: ...
    def release(self, request_id: str) -> None: ...


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor       # rows of the hidden states that feed the sampler
    sample_items: list[int]         # batch item index of each such row


def build_inputs(batch: MicroBatch, block_manager: BlockManager, device: torch.device) -> ModelInputs:
    ids: list[int] = []
    positions: list[int] = []
    query_lens, seq_lens, tables, rows, items = [], [], [], [], []
    for index, item in enumerate(batch.items):
        seq, n = item.seq, item.num_tokens
        start = seq.num_computed_tokens
        prompt_len = seq.prompt_len
        if start + n <= prompt_len:
            ids.extend(seq.request.prompt_token_ids[start:start + n])
        elif n == 1 and start >= prompt_len:  # the usual decode step: just the last output token
            ids.append(seq.output_token_ids[start - prompt_len])
        else:
            ids.extend(seq.token_ids()[start:start + n])
        positions.extend(range(start, start + n))
        query_lens.append(n)
        seq_lens.append(start + n)
        tables.append(block_manager.block_table(seq.request_id))
        if item.samples:
            rows.append(len(ids) - 1)
            items.append(index)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_manager.block_size, device)
    return ModelInputs(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
        logits_rows=torch.tensor(rows, dtype=torch.long, device=device),
        sample_items=items,
    )


class InProcessExecutor:
    """Runs the whole model in this process (single device)."""

    def __init__(self, model: CausalLM, kv_caches: list, backend: AttentionBackend,
                 sampler: Sampler, block_manager: BlockManager, device: torch.device):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.sampler, self.block_manager, self.device = sampler, block_manager, device

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    @torch.inference_mode()
    def execute(self, batch: MicroBatch) -> StepResult:
        t0 = time.perf_counter()
        inputs = build_inputs(batch, self.block_manager, self.device)
        hidden, residual = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                      inputs.meta, self.backend)
        tokens: list[Optional[int]] = [None] * len(batch.items)
        logprobs: list[Optional[dict]] = [None] * len(batch.items)
        t1 = time.perf_counter()
        if inputs.sample_items:
            rows = inputs.logits_rows
            logits = self.model.compute_logits(hidden[rows], None if residual is None else residual[rows])
            seqs = [batch.items[i].seq for i in inputs.sample_items]
            sampled, info = self.sampler.sample(logits, self.sampler.prepare(seqs))
            for row, (index, token) in enumerate(zip(inputs.sample_items, sampled.tolist())):
                tokens[index] = token
                if info is not None and seqs[row].request.sampling.logprobs is not None:
                    logprobs[index] = _row_logprobs(info, row, seqs[row].request.sampling.logprobs)
        t2 = time.perf_counter()
        return StepResult(tokens, logprobs, forward_s=t1 - t0, sample_s=t2 - t1)


def _row_logprobs(info: dict, row: int, top_n: int) -> dict:
    out = {"logprob": float(info["sampled"][row]), "top": []}
    if top_n > 0 and info["top_ids"] is not None:
        ids = info["top_ids"][row, :top_n].tolist()
        values = info["top_values"][row, :top_n].tolist()
        out["top"] = list(zip(ids, values))
    return out
