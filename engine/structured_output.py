"""Structured outputs in the sampler, as vLLM's xgrammar backend does them.

A request's `structured_outputs` (engine/structured_params.py) is compiled against the model's
tokenizer once per distinct spec (xgrammar's TokenizerInfo built once per tokenizer and
vocabulary size, in each process that samples); each request then has a GrammarMatcher. Every step
the sampler asks `StructuredOutputs.prepare` for the rows it samples: a row whose grammar is not
finished gets its allowed tokens as a bitmask row, the step's logits are masked there before
anything else reads them (so logprobs, as vLLM's, are those of the masked distribution), and the
sampled token is accepted by the row's matcher. A finished grammar allows only the stop tokens
(the model's EOS ids and the request's stop_token_ids, vLLM's `all_stop_token_ids`), so the
request ends as vLLM's does: finish_reason "stop" on that token. After it (ignore_eos) the row is
free, as in vLLM.

A batch with no constrained row costs one scan of its rows' parameters per step; nothing here is
imported until a request asks for structured output.

The matcher follows the tokens the row has been given: it counts what it has consumed, and a
sequence whose output the controller trimmed (or that a sampler sees for the first time
mid-reply) is replayed from its output so far.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from .structured_params import (StructuredOutputsParams, grammar_is_likely_lark,
                                structural_tag_grammar, xgrammar)

log = logging.getLogger(__name__)

# compiled grammars kept per process, least recently used dropped first
COMPILED_CACHE_SIZE = 256
_infos: dict[tuple, Any] = {}                   # (tokenizer source, vocab size) -> TokenizerInfo
_compilers: dict[tuple, Any] = {}               # same key -> GrammarCompiler
_compiled: "OrderedDict[tuple, Any]" = OrderedDict()


def tokenizer_info(source: str, vocab_size: int):
    """xgrammar's view of the tokenizer at `source` (a directory AutoTokenizer reads), for a
    model of `vocab_size` ids: built once per process (0.2 s for a 49k vocabulary)."""
    key = (source, vocab_size)
    if key not in _infos:
        from .tokenizer import _hf_tokenizer, _version

        xgr = xgrammar()
        hf = _hf_tokenizer(source, _version(Path(source)))
        _infos[key] = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=max(vocab_size, len(hf)))
    return _infos[key]


def compiled_grammar(source: str, vocab_size: int, params: StructuredOutputsParams):
    """The grammar `params` asks for, compiled against the tokenizer: once per distinct spec."""
    key = (source, vocab_size) + params.spec_key()
    found = _compiled.get(key)
    if found is not None:
        _compiled.move_to_end(key)
        return found
    compiler = _compilers.get(key[:2])
    if compiler is None:
        xgr = xgrammar()
        compiler = _compilers[key[:2]] = xgr.GrammarCompiler(
            tokenizer_info(source, vocab_size), max_threads=min(8, os.cpu_count() or 1))
    compiled = _compile(compiler, *params.spec_key())
    _compiled[key] = compiled
    if len(_compiled) > COMPILED_CACHE_SIZE:
        _compiled.popitem(last=False)
    return compiled


def _compile(compiler, kind: str, spec: Optional[str], no_whitespace: bool):
    """vLLM's XgrammarBackend.compile_grammar (choice arrives as its grammar)."""
    json_options = dict(any_whitespace=not no_whitespace,
                        separators=(",", ":") if no_whitespace else None)
    if kind == "json":
        return compiler.compile_json_schema(spec, **json_options)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', **json_options)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "structural_tag":
        return compiler.compile_grammar(structural_tag_grammar(xgrammar(), spec))
    if grammar_is_likely_lark(spec):
        return compiler.compile_lark(spec)
    return compiler.compile_grammar(spec)


class _RowGrammar:
    """One request's matcher and how many of its output tokens it has consumed."""

    __slots__ = ("matcher", "seen", "terminated")

    def __init__(self, matcher):
        self.matcher, self.seen, self.terminated = matcher, 0, False

    def follow(self, outputs: Sequence[int], request_id: str) -> None:
        """Brings the matcher to the end of `outputs` (the sequence's output tokens, a list or a
        1-D tensor): the tokens it has not consumed, or all of them after a trim."""
        if self.seen > len(outputs):
            self.matcher.reset()
            self.seen, self.terminated = 0, False
        for token in outputs[self.seen:]:
            token = int(token)
            if token < 0:               # a placeholder for a token not read yet (async steps)
                break
            self.take(token, request_id)

    def take(self, token: int, request_id: str) -> None:
        self.seen += 1
        if self.terminated:             # past the grammar's end (vLLM ignores these too)
            return
        if not self.matcher.accept_token(token):
            # only when the request's other constraints left no token the grammar allows (e.g.
            # min_tokens holding back the stop token a finished grammar needs): free from here
            log.warning("request %s: its grammar does not allow the token sampled (%d); its "
                        "remaining tokens are not constrained", request_id, token)
            self.terminated = True
        else:
            self.terminated = self.matcher.is_terminated()


@dataclass
class GrammarStep:
    """One step's constrained rows: the bitmask of those still inside their grammar."""

    bitmask: torch.Tensor               # int32 [rows in the step, ceil(vocab / 32)]
    masked: list[int]                   # rows whose grammar is not finished
    rows: list[tuple[int, _RowGrammar, str]]   # (row, its grammar, request id), every constrained

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] with the masked rows' disallowed tokens at -inf (a copy where any is)."""
        if not self.masked:
            return logits
        logits = logits.clone()
        bitmask = self.bitmask
        cpu = logits.device.type == "cpu"
        if not cpu:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        vocab = min(logits.shape[-1], bitmask.shape[-1] * 32)
        xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab,
                                               indices=self.masked,
                                               backend="cpu" if cpu else "torch_native")
        return logits

    def apply_transposed(self, logits_t: torch.Tensor) -> None:
        """In place on logits laid out [V, B] (a column per row, on the host)."""
        if not self.masked:
            return
        rows = torch.tensor(self.masked)
        block = logits_t[:, rows].t().contiguous()
        bitmask = self.bitmask[rows]
        xgrammar().apply_token_bitmask_inplace(
            block, bitmask, vocab_size=min(block.shape[-1], bitmask.shape[-1] * 32),
            backend="cpu")
        logits_t[:, rows] = block.t()

    def accept(self, tokens: torch.Tensor) -> None:
        """Each constrained row's sampled token, to its matcher (reads the tokens on the host)."""
        values = tokens.tolist()
        for row, grammar, request_id in self.rows:
            grammar.take(values[row], request_id)


class StructuredOutputs:
    """The constrained requests one sampler serves: request id -> its grammar.

    tokenizer_source: the tokenizer's directory (the worker processes load it on the first
    constrained request); None: a sampler that cannot serve one (tests)."""

    def __init__(self, tokenizer_source: Optional[str], vocab_size: int,
                 eos_token_ids: Sequence[int]):
        self.source, self.vocab_size = tokenizer_source, vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._rows: dict[str, _RowGrammar] = {}
        self._bitmask: Optional[torch.Tensor] = None
        self._width = (vocab_size + 31) // 32     # the bitmask's int32 words (xgrammar's vocab)

    def __len__(self) -> int:
        return len(self._rows)

    def release(self, request_id: str) -> None:
        if self._rows:
            self._rows.pop(request_id, None)

    def retain(self, request_ids: set) -> None:
        """Forgets every request not in `request_ids` (a sampler told only who stays)."""
        for rid in [r for r in self._rows if r not in request_ids]:
            del self._rows[rid]

    def prepare(self, seqs: Sequence) -> Optional[GrammarStep]:
        """The step of engine Sequences (None: no row is constrained, the usual case)."""
        rows = [i for i, s in enumerate(seqs) if s.request.sampling.structured_outputs is not None]
        if not rows:
            return None
        return self.step(len(seqs), [(i, seqs[i].request_id, seqs[i].request.sampling,
                                      seqs[i].output_token_ids) for i in rows])

    def step(self, batch_size: int, rows: list[tuple]) -> GrammarStep:
        """rows: (row, request id, SamplingParams, its output tokens so far) per constrained row
        of a step of `batch_size` rows."""
        grammars = []
        for row, request_id, params, outputs in rows:
            grammar = self._rows.get(request_id)
            if grammar is None:
                grammar = self._rows[request_id] = self._new(params)
            grammar.follow(outputs, request_id)
            grammars.append((row, grammar, request_id))
        bitmask = self._bitmask_rows(batch_size)
        masked = [row for row, grammar, _ in grammars if not grammar.terminated]
        for row, grammar, _ in grammars:
            if not grammar.terminated:
                grammar.matcher.fill_next_token_bitmask(bitmask, row)
        return GrammarStep(bitmask, masked, grammars)

    def _new(self, params) -> _RowGrammar:
        if self.source is None:
            raise RuntimeError("this sampler was built without its tokenizer's directory, so "
                               "it cannot constrain a request's output (structured_outputs)")
        xgr = xgrammar()
        compiled = compiled_grammar(self.source, self.vocab_size, params.structured_outputs)
        self._width = (compiled.tokenizer_info.vocab_size + 31) // 32
        stops = sorted(set(self.eos_token_ids) | set(params.stop_token_ids or ()))
        return _RowGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None))

    def _bitmask_rows(self, batch_size: int) -> torch.Tensor:
        if (self._bitmask is None or self._bitmask.shape[0] < batch_size
                or self._bitmask.shape[1] != self._width):
            self._bitmask = torch.full((max(batch_size, 64), self._width), -1, dtype=torch.int32)
        return self._bitmask[:batch_size]


def tokenizer_source(tokenizer) -> Optional[str]:
    """The directory an engine Tokenizer was read from (what a worker loads it from)."""
    return getattr(getattr(tokenizer, "hf", None), "name_or_path", None) or None


def check_grammar(request, tokenizer, vocab_size: int) -> None:
    """A RequestError (invalid_sampling) where a request's structured_outputs does not compile
    against the model's tokenizer; the engine asks at admission, so a grammar that fails fails
    its request alone, and the compiled grammar is in this process's cache for the sampler."""
    from .errors import RequestError

    source = tokenizer_source(tokenizer)
    if source is None:
        raise RequestError("invalid_sampling", "structured_outputs: the engine's tokenizer has "
                           "no directory to build the grammar's vocabulary from")
    try:
        compiled_grammar(source, vocab_size, request.sampling.structured_outputs)
    except ValueError as exc:                 # xgrammar is not installed
        raise RequestError("invalid_sampling", f"structured_outputs: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - xgrammar's RuntimeErrors
        raise RequestError("invalid_sampling", "structured_outputs: xgrammar cannot compile it "
                           f"for this model's tokenizer: {exc}") from None
