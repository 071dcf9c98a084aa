"""One replica of SiPipe's column-wise sampling state, and the step that samples from it (§5.1).

Everything is laid out vocabulary x column ([V, C]): the logits of a micro-batch arrive
transposed (the last stage computes W @ h^T straight into the replica's logits slot), and the
per-sequence penalty state sits beside them in three preallocated buffers, one per penalty:
`seen` (repetition: the token is in the prompt or the output), `counts` (frequency: occurrences
in the output) and `present` (presence: counts > 0). The outputs themselves are an [L_max, C]
buffer. After a step only the B new tokens are written (B scattered elements per buffer); a
sequence's column is rebuilt from scratch only when it joins the replica. Per-column sampling
parameters are tensors that change only on a join or a move, so a step builds no per-row tensors.

The arithmetic is the engine's default sampler's (engine/sampler.py), so a seeded request gets the
same tokens from either: the compiled column kernels are bitwise equal to the row kernels.
"""
from __future__ import annotations

from typing import Optional

import torch

from batchinfer.engine.executor import _row_logprobs
from batchinfer.engine.sampler import SamplingBatch, attach_sampled, raw_logprobs, sample_torch
from batchinfer.engine.sampler import uniform_draw
from batchinfer.engine.structured_output import GrammarStep, StructuredOutputs
from batchinfer.engine.token_constraints import CONSTRAINT_DTYPES, TokenConstraints, bad_word_bans

from .columns import ColumnJoin, ColumnUpdate


def _host_tensors(columns: dict) -> dict:
    return {name: torch.tensor(values, dtype=CONSTRAINT_DTYPES[name])
            for name, values in columns.items()}


class ColumnSampler:
    def __init__(self, vocab_size: int, capacity: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...], native_kernels: bool,
                 tokenizer_source: Optional[str] = None):
        V, C = vocab_size, capacity
        self.vocab_size, self.capacity, self.max_model_len = V, C, max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.native = native_kernels
        self.seen = torch.zeros((V, C), dtype=torch.uint8)
        self.counts = torch.zeros((V, C), dtype=torch.float32)
        self.present = torch.zeros((V, C), dtype=torch.float32)
        self.outputs = torch.zeros((max_model_len, C), dtype=torch.int32)   # Y: [L_max, C]
        self.lengths = torch.zeros(C, dtype=torch.long)
        self.temperature = torch.zeros(C, dtype=torch.float32)
        self.top_k = torch.zeros(C, dtype=torch.long)
        self.top_p = torch.ones(C, dtype=torch.float32)
        self.min_p = torch.zeros(C, dtype=torch.float32)
        self.repetition = torch.ones(C, dtype=torch.float32)
        self.frequency = torch.zeros(C, dtype=torch.float32)
        self.presence = torch.zeros(C, dtype=torch.float32)
        self.params: list = [None] * C          # SamplingParams of each column
        self.seeds: list[int] = [0] * C
        self.request_ids: list = [None] * C
        self.bad_words: list = [None] * C       # each column's bad words as token ids, or None
        # structured_outputs: each constrained column's grammar follows its reply in Y (a
        # column that joins mid-reply is replayed); tokenizer_source, the grammars' vocabulary
        self.grammars = StructuredOutputs(tokenizer_source, V, eos_token_ids)
        self._tensors = (self.seen, self.counts, self.present, self.outputs)
        self._vectors = (self.lengths, self.temperature, self.top_k, self.top_p, self.min_p,
                         self.repetition, self.frequency, self.presence)

    # --- membership -----------------------------------------------------------------------------
    def apply(self, update: ColumnUpdate) -> None:
        for src, dst in update.moves:
            self._move(src, dst)
        for join in update.joins:
            self._join(join)
        if len(self.grammars):          # the grammars of sequences that left go with them
            self.grammars.retain(set(self.request_ids[:update.width]))

    def _move(self, src: int, dst: int) -> None:
        for t in self._tensors:
            t[:, dst] = t[:, src]
        for v in self._vectors:
            v[dst] = v[src]
        for lst in (self.params, self.seeds, self.request_ids, self.bad_words):
            lst[dst] = lst[src]

    def _join(self, join: ColumnJoin) -> None:
        col, sp = join.column, join.sampling
        outputs = join.output_token_ids
        if len(outputs) > self.max_model_len:
            raise ValueError(f"{join.request_id}: {len(outputs)} output tokens exceed the "
                             f"sampler's {self.max_model_len}")
        self.seen[:, col] = 0
        self.counts[:, col] = 0
        self.present[:, col] = 0
        if join.prompt_token_ids:
            self.seen[torch.tensor(join.prompt_token_ids, dtype=torch.long), col] = 1
        if outputs:
            out = torch.tensor(outputs, dtype=torch.long)
            self.counts[:, col].index_add_(0, out, torch.ones(len(outputs)))
            self.present[out, col] = 1.0
            self.seen[out, col] = 1
            self.outputs[:len(outputs), col] = out.to(torch.int32)
        self.lengths[col] = len(outputs)
        self.temperature[col] = 0.0 if sp.greedy else sp.temperature
        self.top_k[col] = sp.top_k if sp.top_k_active else 0
        self.top_p[col] = sp.top_p
        self.min_p[col] = sp.min_p
        self.repetition[col] = sp.repetition_penalty
        self.frequency[col] = sp.frequency_penalty
        self.presence[col] = sp.presence_penalty
        self.params[col], self.seeds[col], self.request_ids[col] = sp, join.seed, join.request_id
        self.bad_words[col] = join.bad_words_token_ids

    # --- the step -------------------------------------------------------------------------------
    def sample(self, logits_t: torch.Tensor):
        """logits_t [V, n] float32, column b = the sequence in column b (overwritten in place).

        -> (tokens: list[int], logprobs: list[dict | None]) in column order."""
        n = logits_t.shape[1]
        params = self.params[:n]
        want = [p.logprobs for p in params]
        grammar = self._grammar(params)
        if grammar is not None:         # first: the logprobs are the masked logits', as vLLM's
            grammar.apply_transposed(logits_t)
        info = None
        if any(w is not None for w in want):
            info = raw_logprobs(logits_t.t(), max(w or 0 for w in want))
        lengths = self.lengths[:n].tolist()
        # allowed ids, bad words (against each column's reply in Y), logit_bias
        constraints = TokenConstraints.of(params, _host_tensors, self._bad_word_bans(n, lengths))
        if constraints is not None:
            constraints.apply(logits_t.t())
        for col, p in enumerate(params):
            if lengths[col] < p.min_tokens:
                stop = list(self.eos_token_ids) + list(p.stop_token_ids or [])
                logits_t[stop, col] = float("-inf")
        if any(p.uses_penalties for p in params):
            self._apply_penalties(logits_t, n)
        tokens = self._draw(logits_t, params, lengths)
        if grammar is not None:
            grammar.accept(tokens)
        self._record(tokens, n)
        logprobs: list = [None] * n
        if info is not None:
            info = attach_sampled(info, tokens)
            for col, w in enumerate(want):
                if w is not None:
                    logprobs[col] = _row_logprobs(info, col, w)
        return tokens.tolist(), logprobs

    def _bad_word_bans(self, n: int, lengths: list[int]) -> list[tuple]:
        """bad_word_bans of the first n columns: each word against its column's last tokens."""
        rows = []
        for col in range(n):
            words = self.bad_words[col]
            if words:
                longest = max(len(ids) for ids in words) - 1
                end = lengths[col]
                reply = self.outputs[max(0, end - longest):end, col].tolist()
                rows.append((col, words, reply))
        return bad_word_bans(rows) if rows else []

    def _grammar(self, params: list) -> Optional[GrammarStep]:
        constrained = [c for c, p in enumerate(params) if p.structured_outputs is not None]
        if not constrained:
            return None
        return self.grammars.step(len(params), [
            (c, self.request_ids[c], params[c], self.outputs[:int(self.lengths[c]), c])
            for c in constrained])

    def _apply_penalties(self, logits_t: torch.Tensor, n: int) -> None:
        """Z := penalized Z, over the whole [V, n] block against the aligned buffers."""
        if self.native:
            torch.ops.batchinfer.apply_penalties_columns_(
                logits_t, self.seen, self.counts, self.present, self.repetition[:n],
                self.frequency[:n], self.presence[:n])
            return
        seen = self.seen[:, :n].bool()
        rep = self.repetition[:n]
        penalized = torch.where(logits_t > 0, logits_t / rep, logits_t * rep)
        penalized -= self.frequency[:n] * self.counts[:, :n] + self.presence[:n] * self.present[:, :n]
        logits_t.copy_(torch.where(seen, penalized, logits_t))

    def _draw(self, logits_t: torch.Tensor, params, lengths: list[int]) -> torch.Tensor:
        n = len(params)
        uniform = torch.full((n,), 0.5, dtype=torch.float64)
        for col, p in enumerate(params):
            if not p.greedy:
                uniform[col] = uniform_draw(self.seeds[col], lengths[col])
        if self.native:
            return torch.ops.batchinfer.sample_columns(
                logits_t, self.temperature[:n], self.top_k[:n], self.top_p[:n], self.min_p[:n],
                uniform)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        batch = SamplingBatch(
            temperature=self.temperature[:n].clone(), all_greedy=not sampled,
            top_k=self.top_k[:n].clone(), top_p=self.top_p[:n].clone(),
            min_p=self.min_p[:n].clone(), uniform=uniform,
            use_top_k=any(params[i].top_k_active for i in sampled),
            use_top_p=any(params[i].top_p < 1.0 for i in sampled),
            use_min_p=any(params[i].min_p > 0.0 for i in sampled),
            penalty_rows=None, repetition=None, frequency=None, presence=None, prompt_tokens=None,
            output_tokens=None, min_tokens_rows=None, min_tokens_stop_ids=None, max_logprobs=0)
        return sample_torch(logits_t.t().contiguous(), batch)

    def _record(self, tokens: torch.Tensor, n: int) -> None:
        """The incremental update: B new tokens, one element per buffer and column."""
        cols = torch.arange(n)
        lengths = self.lengths[:n]
        if int(lengths.max()) >= self.max_model_len:
            raise ValueError(f"a sequence reached the sampler's {self.max_model_len} tokens")
        self.counts[tokens, cols] += 1.0
        self.present[tokens, cols] = 1.0
        self.seen[tokens, cols] = 1
        self.outputs[lengths, cols] = tokens.to(torch.int32)
        self.lengths[:n] += 1
