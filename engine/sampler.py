"""Batched sampling with vLLM's SamplingParams semantics.

Order per step, as vLLM V1: the structured_outputs grammars' mask (structured_output.py) -> raw
logprobs (if asked) -> min_tokens masking of stop tokens ->
repetition / frequency / presence penalties -> greedy argmax for temperature-0 rows; for the rest
temperature -> min_p -> top_k -> top_p -> one draw from the filtered distribution.

The draw is an inverse-CDF lookup with one uniform number per row, u = hash(seed, position): a
request's seed (its own, or one the engine draws for it once) and the index of the token being
sampled. So a seeded request samples the same tokens whatever else shares the batch, and even
after a preemption. Every transform is a tensor op over the whole batch (or one fused CPU
kernel, kernels/sampling.cpp); work that no row needs is skipped.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import torch

from .host_to_device import packed_to_device
from .request import Sequence
from .structured_output import GrammarStep, StructuredOutputs
from .token_constraints import CONSTRAINT_DTYPES, TokenConstraints, sequence_bans
from .token_history import TokenHistory

_MASK64 = (1 << 64) - 1
# the dtype of each per-row column SamplingBatch holds
ROW_DTYPES = {"temperature": torch.float32, "top_k": torch.long, "top_p": torch.float32,
              "min_p": torch.float32, "uniform": torch.float64, "penalty_rows": torch.long,
              "repetition": torch.float32, "frequency": torch.float32, "presence": torch.float32,
              "rows": torch.long, "ids": torch.long, **CONSTRAINT_DTYPES}


def uniform_draw(seed: int, position: int) -> float:
    """A number in (0, 1) from (seed, position): splitmix64 over the pair."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return ((z >> 11) + 0.5) / float(1 << 53)


@dataclass
class SamplingBatch:
    """Per-row tensors for one step, built from the sequences being sampled."""

    # the five per-row tensors are None in an all-greedy batch from Sampler.prepare (argmax needs
    # none of them: not building them saves the step five host-to-device copies)
    temperature: Optional[torch.Tensor]  # [B] float (0 for greedy rows)
    all_greedy: bool
    top_k: Optional[torch.Tensor]        # [B] long, 0 where disabled
    top_p: Optional[torch.Tensor]        # [B] float
    min_p: Optional[torch.Tensor]        # [B] float
    uniform: Optional[torch.Tensor]      # [B] float64 in (0, 1)
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    penalty_rows: Optional[torch.Tensor]  # [P] row indices with any penalty
    repetition: Optional[torch.Tensor]   # [P]
    frequency: Optional[torch.Tensor]    # [P]
    presence: Optional[torch.Tensor]     # [P]
    prompt_tokens: Optional[torch.Tensor]  # [P, Lp] long, padded with vocab_size
    output_tokens: Optional[torch.Tensor]  # [P, Lo] long, padded with vocab_size
    min_tokens_rows: Optional[list[int]]  # rows still under min_tokens
    min_tokens_stop_ids: Optional[list[list[int]]]
    max_logprobs: int                    # 0 when no row wants logprobs
    top_k_max: Optional[int] = None      # the largest k over rows (vocab where off), from the host
    min_tokens_index: Optional[tuple] = None  # (rows, token ids) tensors to mask, one index_put
    constraints: Optional[TokenConstraints] = None  # allowed_token_ids, bad_words, logit_bias
    grammar: Optional[GrammarStep] = None  # structured_outputs rows (structured_output.py)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device,
                 seed: int = 0, native_kernels: bool = False,
                 tokenizer_source: Optional[str] = None):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.native = native_kernels
        self._rng = random.Random(seed)
        self._seeds: dict[str, int] = {}
        self._history = TokenHistory()
        # tokenizer_source: the tokenizer's directory, for structured_outputs' grammars
        self.grammars = StructuredOutputs(tokenizer_source, vocab_size, eos_token_ids)

    def release(self, request_id: str) -> None:
        self._seeds.pop(request_id, None)
        self._history.release(request_id)
        self.grammars.release(request_id)

    def _seed_of(self, seq: Sequence) -> int:
        seed = seq.request.sampling.seed
        if seed is not None:
            return seed
        rid = seq.request_id
        if rid not in self._seeds:
            self._seeds[rid] = self._rng.getrandbits(63)
        return self._seeds[rid]

    # --- building the per-step batch ----------------------------------------------------------
    def prepare(self, seqs: list[Sequence]) -> SamplingBatch:
        """The step's per-row tensors. On CUDA each group travels in one pinned, non-blocking copy
        (host_to_device.py): the rows' numbers (none for an all-greedy batch), the penalties'
        numbers and their two token histories, the min_tokens masks; preparing never waits for
        the GPU."""
        params = [s.request.sampling for s in seqs]
        dev = self.device
        greedy = [p.greedy for p in params]
        sampled = [i for i, g in enumerate(greedy) if not g]
        rows: dict = dict(temperature=None, top_k=None, top_p=None, min_p=None, uniform=None)
        if sampled:
            uniform = [0.5] * len(seqs)
            for i in sampled:
                uniform[i] = uniform_draw(self._seed_of(seqs[i]), len(seqs[i].output_token_ids))
            rows = self._tensors({
                "temperature": [0.0 if g else p.temperature for g, p in zip(greedy, params)],
                "top_k": [p.top_k if p.top_k_active else 0 for p in params],
                "top_p": [p.top_p for p in params], "min_p": [p.min_p for p in params],
                "uniform": uniform})
        pen = [i for i, p in enumerate(params) if p.uses_penalties]
        penalty_fields: dict = dict(penalty_rows=None, repetition=None, frequency=None,
                                    presence=None, prompt_tokens=None, output_tokens=None)
        if pen:
            prompt_tokens, output_tokens = self._history.padded([seqs[i] for i in pen],
                                                                self.vocab_size, dev)
            penalty_fields = dict(
                **self._tensors({"penalty_rows": pen,
                                 "repetition": [params[i].repetition_penalty for i in pen],
                                 "frequency": [params[i].frequency_penalty for i in pen],
                                 "presence": [params[i].presence_penalty for i in pen]}),
                prompt_tokens=prompt_tokens, output_tokens=output_tokens,
            )
        under_min = [i for i, (s, p) in enumerate(zip(seqs, params))
                     if len(s.output_token_ids) < p.min_tokens]
        stop_ids = [list(self.eos_token_ids) + list(params[i].stop_token_ids or [])
                    for i in under_min]
        min_index = None
        if under_min:
            masked = self._tensors({"rows": [r for r, ids in zip(under_min, stop_ids) for _ in ids],
                                    "ids": [t for ids in stop_ids for t in ids]})
            min_index = (masked["rows"], masked["ids"])
        vocab = self.vocab_size
        return SamplingBatch(
            **rows,
            all_greedy=not sampled,
            use_top_k=any(params[i].top_k_active for i in sampled),
            use_top_p=any(params[i].top_p < 1.0 for i in sampled),
            use_min_p=any(params[i].min_p > 0.0 for i in sampled),
            **penalty_fields,
            min_tokens_rows=under_min or None,
            min_tokens_stop_ids=stop_ids or None,
            max_logprobs=max((p.logprobs or 0) if p.logprobs is not None else -1 for p in params) + 1,
            top_k_max=max((min(max(p.top_k, 1), vocab) if p.top_k_active else vocab
                           for p in params), default=vocab),
            min_tokens_index=min_index,
            constraints=TokenConstraints.of(params, self._tensors, sequence_bans(seqs)),
            grammar=self.grammars.prepare(seqs),
        )

    def _tensors(self, columns: dict[str, list]) -> dict[str, torch.Tensor]:
        """Named per-row columns as tensors on the device, in ROW_DTYPES (one copy on CUDA)."""
        return packed_to_device(columns, ROW_DTYPES, self.device, carrier=torch.float64)

    # --- the step -------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, batch: SamplingBatch):
        """logits [B, V] float32 -> (token ids [B] long, logprob info or None)."""
        if batch.grammar is not None:          # first: vLLM's logprobs are of the masked logits
            logits = batch.grammar.apply(logits)
        logprob_info = raw_logprobs(logits, batch.max_logprobs - 1) if batch.max_logprobs > 0 else None
        if (batch.min_tokens_rows is not None or batch.penalty_rows is not None
                or batch.constraints is not None):
            logits = logits.clone()
        if batch.constraints is not None:      # before penalties, as vLLM applies them
            batch.constraints.apply(logits)
        if batch.min_tokens_index is not None:
            logits[batch.min_tokens_index] = float("-inf")
        elif batch.min_tokens_rows is not None:
            for row, ids in zip(batch.min_tokens_rows, batch.min_tokens_stop_ids):
                logits[row, ids] = float("-inf")
        if batch.penalty_rows is not None and self.native:
            torch.ops.batchinfer.apply_penalties_(logits, batch.penalty_rows, batch.prompt_tokens,
                                                  batch.output_tokens, batch.repetition,
                                                  batch.frequency, batch.presence)
        elif batch.penalty_rows is not None:
            logits[batch.penalty_rows] = apply_penalties(
                logits[batch.penalty_rows], batch.prompt_tokens, batch.output_tokens,
                batch.repetition, batch.frequency, batch.presence)
        if batch.all_greedy:
            tokens = (torch.ops.batchinfer.argmax_rows(logits) if self.native
                      else logits.argmax(dim=-1))
        elif self.native:
            tokens = torch.ops.batchinfer.sample_rows(logits, batch.temperature, batch.top_k,
                                                      batch.top_p, batch.min_p, batch.uniform)
        else:
            tokens = sample_torch(logits, batch)
        if batch.grammar is not None:
            batch.grammar.accept(tokens)
        if logprob_info is not None:
            logprob_info = attach_sampled(logprob_info, tokens)
        return tokens, logprob_info


# --- the transforms, each usable and testable on its own ---------------------------------------
def sample_torch(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The portable path: filters as tensor ops, then an inverse-CDF lookup per row."""
    greedy = batch.temperature <= 0
    temp = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    scaled = logits / temp.unsqueeze(1)
    if batch.use_min_p:
        scaled = apply_min_p(scaled, batch.min_p)
    if batch.use_top_k or batch.use_top_p:
        vocab = logits.shape[-1]
        top_k = torch.where(batch.top_k > 0, batch.top_k, torch.full_like(batch.top_k, vocab))
        scaled = apply_top_k_top_p(scaled, top_k if batch.use_top_k else None,
                                   batch.top_p if batch.use_top_p else None, batch.top_k_max)
    cdf = torch.softmax(scaled, dim=-1, dtype=torch.float64).cumsum(dim=-1)
    target = (batch.uniform * cdf[:, -1]).unsqueeze(1)
    drawn = torch.searchsorted(cdf, target).squeeze(1).clamp_(max=logits.shape[-1] - 1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


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
                      top_p: Optional[torch.Tensor], k_max: Optional[int] = None) -> torch.Tensor:
    """Keeps each row's top_k tokens, then its largest tokens while the kept mass before them is
    below top_p. Tokens tied with the last kept value are kept. k_max: the largest k, when the
    caller knows it on the host (reading it from top_k would wait for the device)."""
    vocab = logits.shape[-1]
    if top_k is not None:
        if k_max is None:
            k_max = int(top_k.clamp(1, vocab).max())
        kth = logits.topk(k_max, dim=-1).values
        threshold = kth.gather(1, (top_k.clamp(1, vocab) - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if top_p is not None:
        sorted_logits = logits.sort(dim=-1, descending=True).values
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs
        keep = before < top_p.unsqueeze(1)
        last_kept = keep.sum(dim=-1, keepdim=True) - 1
        threshold = sorted_logits.gather(1, last_kept)
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    return logits


def raw_logprobs(logits: torch.Tensor, top_n: int):
    logprobs = torch.log_softmax(logits, dim=-1)
    top_values, top_ids = (logprobs.topk(top_n, dim=-1) if top_n > 0 else (None, None))
    return {"logprobs": logprobs, "top_values": top_values, "top_ids": top_ids}


def attach_sampled(info: dict, tokens: torch.Tensor) -> dict:
    info["sampled"] = info.pop("logprobs").gather(1, tokens.unsqueeze(1)).squeeze(1)
    return info
