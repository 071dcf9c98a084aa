"""Batched sampling with vLLM's SamplingParams semantics.

Order per step, as vLLM V1: raw logprobs (if asked) -> min_tokens masking of stop tokens ->
repetition / frequency / presence penalties -> greedy argmax for temperature-0 rows; for the rest
temperature -> min_p -> top_k -> top_p -> a sample drawn by the exponential race
(argmax of probs / Exp(1) noise). Rows with a seed draw their noise from their own generator, so a
seeded request samples the same tokens whatever else shares the batch. Every transform is a tensor
op over the whole batch; work that no row needs is skipped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .request import Sequence


@dataclass
class SamplingBatch:
    """Per-row tensors for one step, built from the sequences being sampled."""

    temperature: torch.Tensor            # [B] float (0 for greedy rows)
    greedy: torch.Tensor                 # [B] bool
    all_greedy: bool
    top_k: Optional[torch.Tensor]        # [B] long, vocab size where disabled
    top_p: Optional[torch.Tensor]        # [B] float
    min_p: Optional[torch.Tensor]        # [B] float
    penalty_rows: Optional[torch.Tensor]  # [P] row indices with any penalty
    repetition: Optional[torch.Tensor]   # [P]
    frequency: Optional[torch.Tensor]    # [P]
    presence: Optional[torch.Tensor]     # [P]
    prompt_tokens: Optional[torch.Tensor]  # [P, Lp] long, padded with vocab_size
    output_tokens: Optional[torch.Tensor]  # [P, Lo] long, padded with vocab_size
    min_tokens_rows: Optional[torch.Tensor]  # [M] rows still under min_tokens
    min_tokens_stop_ids: Optional[list[list[int]]]
    seeded_rows: list[tuple[int, torch.Generator]]
    max_logprobs: int                    # 0 when no row wants logprobs


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device,
                 seed: int = 0, native_kernels: bool = False):
        self.vocab_size = vocab_size
        self._argmax = _native_argmax if native_kernels else _torch_argmax
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seeded: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._seeded.pop(request_id, None)

    # --- building the per-step batch ----------------------------------------------------------
    def prepare(self, seqs: list[Sequence]) -> SamplingBatch:
        params = [s.request.sampling for s in seqs]
        dev, vocab = self.device, self.vocab_size
        greedy_list = [p.greedy for p in params]
        temperature = torch.tensor([0.0 if g else p.temperature for g, p in zip(greedy_list, params)],
                                   dtype=torch.float32, device=dev)
        sampled = [i for i, g in enumerate(greedy_list) if not g]
        top_k = top_p = min_p = None
        if any(params[i].top_k_active for i in sampled):
            top_k = torch.tensor([p.top_k if p.top_k_active and not p.greedy else vocab
                                  for p in params], dtype=torch.long, device=dev)
        if any(params[i].top_p < 1.0 for i in sampled):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        if any(params[i].min_p > 0.0 for i in sampled):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        pen = [i for i, p in enumerate(params) if p.uses_penalties]
        penalty_fields: dict = dict(penalty_rows=None, repetition=None, frequency=None,
                                    presence=None, prompt_tokens=None, output_tokens=None)
        if pen:
            penalty_fields = dict(
                penalty_rows=torch.tensor(pen, dtype=torch.long, device=dev),
                repetition=torch.tensor([params[i].repetition_penalty for i in pen], device=dev),
                frequency=torch.tensor([params[i].frequency_penalty for i in pen], device=dev),
                presence=torch.tensor([params[i].presence_penalty for i in pen], device=dev),
                prompt_tokens=_padded([seqs[i].request.prompt_token_ids for i in pen], vocab, dev),
                output_tokens=_padded([seqs[i].output_token_ids for i in pen], vocab, dev),
            )
        under_min = [i for i, (s, p) in enumerate(zip(seqs, params))
                     if len(s.output_token_ids) < p.min_tokens]
        seeded_rows = []
        for i in sampled:
            seed = params[i].seed
            if seed is not None:
                rid = seqs[i].request_id
                gen = self._seeded.get(rid)
                if gen is None:
                    gen = torch.Generator(device=dev)
                    gen.manual_seed(seed)
                    self._seeded[rid] = gen
                seeded_rows.append((i, gen))
        return SamplingBatch(
            temperature=temperature,
            greedy=torch.tensor(greedy_list, dtype=torch.bool, device=dev),
            all_greedy=all(greedy_list),
            top_k=top_k, top_p=top_p, min_p=min_p, **penalty_fields,
            min_tokens_rows=torch.tensor(under_min, dtype=torch.long, device=dev) if under_min else None,
            min_tokens_stop_ids=[list(self.eos_token_ids) + list(params[i].stop_token_ids or [])
                                 for i in under_min] if under_min else None,
            seeded_rows=seeded_rows,
            max_logprobs=max((p.logprobs or 0) if p.logprobs is not None else -1 for p in params) + 1,
        )

    # --- the step -------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, batch: SamplingBatch):
        """logits [B, V] float32 -> (token ids [B] long, logprob info or None)."""
        logprob_info = None
        if batch.max_logprobs > 0:
            logprob_info = raw_logprobs(logits, batch.max_logprobs - 1)
        if batch.min_tokens_rows is not None:
            logits = logits.clone()
            for row, ids in zip(batch.min_tokens_rows.tolist(), batch.min_tokens_stop_ids):
                logits[row, ids] = float("-inf")
        if batch.penalty_rows is not None:
            logits = logits.clone() if batch.min_tokens_rows is None else logits
            logits[batch.penalty_rows] = apply_penalties(
                logits[batch.penalty_rows], batch.prompt_tokens, batch.output_tokens,
                batch.repetition, batch.frequency, batch.presence)
        greedy_tokens = self._argmax(logits)
        if batch.all_greedy:
            tokens = greedy_tokens
        else:
            temp = torch.where(batch.greedy, torch.ones_like(batch.temperature), batch.temperature)
            scaled = logits / temp.unsqueeze(1)
            if batch.min_p is not None:
                scaled = apply_min_p(scaled, batch.min_p)
            if batch.top_k is not None or batch.top_p is not None:
                scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
            probs = torch.softmax(scaled, dim=-1)
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for row, gen in batch.seeded_rows:
                noise[row].exponential_(generator=gen)
            sampled = probs.div_(noise).argmax(dim=-1)
            tokens = torch.where(batch.greedy, greedy_tokens, sampled)
        if logprob_info is not None:
            logprob_info = attach_sampled(logprob_info, tokens)
        return tokens, logprob_info


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _native_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.ops.batchinfer.argmax_rows(logits)


# --- the transforms, each usable and testable on its own ---------------------------------------
def apply_penalties(logits: torch.Tensor, prompt_tokens: torch.Tensor, output_tokens: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties on rows [P, V]; token id V in the token tensors is padding."""
    rows, vocab = logits.shape
    counts = torch.zeros((rows, vocab + 1), dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, output_tokens, torch.ones_like(output_tokens, dtype=logits.dtype))
    counts = counts[:, :vocab]
    seen = torch.zeros((rows, vocab + 1), dtype=torch.bool, device=logits.device)
    seen.scatter_(1, prompt_tokens, True)
    seen = seen[:, :vocab] | (counts > 0)
    rep = repetition.unsqueeze(1).expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency.unsqueeze(1) * counts
    return logits - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below min_p x the top token's."""
    probs = torch.softmax(logits, dim=-1)
    top = probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < min_p.unsqueeze(1) * top, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Keeps each row's top_k tokens, then the smallest set whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = (vocab - top_k.clamp(1, vocab)).unsqueeze(1)
        threshold = sorted_logits.gather(1, kth)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p.unsqueeze(1))
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def raw_logprobs(logits: torch.Tensor, top_n: int):
    logprobs = torch.log_softmax(logits, dim=-1)
    top_values, top_ids = (logprobs.topk(top_n, dim=-1) if top_n > 0 else (None, None))
    return {"logprobs": logprobs, "top_values": top_values, "top_ids": top_ids}


def attach_sampled(info: dict, tokens: torch.Tensor) -> dict:
    info["sampled"] = info.pop("logprobs").gather(1, tokens.unsqueeze(1)).squeeze(1)
    return info
