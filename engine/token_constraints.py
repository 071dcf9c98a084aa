"""Per-request constraints on which tokens a step samples, as vLLM's sampler applies them:
`allowed_token_ids` (every other token's logit to -inf), then `bad_words` (a word's last token to
-inf where the reply so far ends with the word's other tokens: vLLM's apply_bad_words), then
`logit_bias` (a number added to some tokens' logits). All come before the penalties and the
sampling filters, after the raw log-probabilities are read (logprobs report the model's
distribution, as vLLM's default `raw_logprobs` mode does).

Built once per step from the rows' SamplingParams (and, for bad words, the rows' replies so far)
into index tensors, so applying them is three tensor ops whatever the batch holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from .errors import RequestError

# words a request may ban once tokenized (with and without a leading space): vLLM's
# VLLM_MAX_NUM_BAD_WORDS default
MAX_BAD_WORDS = 128


def bad_words_token_ids(tokenizer, words: Sequence[str], vocab_size: int) -> list[list[int]]:
    """vLLM's SamplingParams.update_from_tokenizer: each word (its leading whitespace stripped)
    tokenized without special tokens, as written and with a leading space (so that it is banned
    at the start of the reply and after a space: "Paris" and " Paris" are different tokens);
    the spaced form only where it gives another first token and as many tokens. RequestError
    (invalid_sampling) for a word with no tokens, too many, or ids past the model's vocabulary.
    `tokenizer`: the engine's Tokenizer."""
    out: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = list(tokenizer.hf.encode(prefix + word.lstrip(), add_special_tokens=False))
            if not ids:
                if not prefix:
                    raise RequestError("invalid_sampling", f"bad_words: {word!r} gives no token "
                                       "(each word must tokenize to at least one token)")
                continue
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
        if len(out) > MAX_BAD_WORDS:
            raise RequestError("invalid_sampling", f"bad_words: {len(out)} token sequences "
                               f"(each word with and without a leading space), more than vLLM's "
                               f"{MAX_BAD_WORDS}")
    bad = [t for ids in out for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError("invalid_sampling", f"bad_words: token ids {bad[:5]} are past this "
                           f"model's vocabulary (0..{vocab_size - 1})")
    return out


def tokenize_bad_words(request, tokenizer, vocab_size: int) -> None:
    """A request's bad_words as token ids (Request.bad_words_token_ids), when the engine admits
    it: tokenized once, as vLLM does when a request comes."""
    if request.sampling.bad_words:
        request.bad_words_token_ids = bad_words_token_ids(tokenizer, request.sampling.bad_words,
                                                          vocab_size)


def bad_word_bans(rows: Iterable[tuple[int, list[list[int]], Sequence[int]]]) -> list[tuple]:
    """(row, token id) to ban in this step: for each (row, its bad words' token ids, its reply's
    tokens so far), each word's last token where the reply ends with the word's other tokens
    (a one-token word always)."""
    bans = []
    for row, words, reply in rows:
        for ids in words:
            prefix = len(ids) - 1
            if prefix > len(reply):
                continue
            if prefix == 0 or list(reply[len(reply) - prefix:]) == ids[:-1]:
                bans.append((row, ids[-1]))
    return bans


def sequence_bans(seqs: Sequence) -> list[tuple]:
    """bad_word_bans of the engine's sequences (their requests' bad_words_token_ids, set when
    the engine admitted them), by row."""
    rows = [(row, seq.request.bad_words_token_ids, seq.output_token_ids)
            for row, seq in enumerate(seqs) if seq.request.bad_words_token_ids]
    return bad_word_bans(rows) if rows else []


@dataclass
class TokenConstraints:
    allowed_rows: Optional[torch.Tensor] = None    # [A] rows with allowed_token_ids
    allowed_index: Optional[tuple] = None          # (position in allowed_rows, token id) pairs
    bias_index: Optional[tuple] = None             # (row, token id) pairs
    bias_values: Optional[torch.Tensor] = None     # [N] float32, one per pair
    banned_index: Optional[tuple] = None           # (row, token id) pairs: bad words

    @classmethod
    def of(cls, params: Sequence, to_device: Callable[[dict], dict],
           bans: Sequence[tuple] = ()) -> Optional["TokenConstraints"]:
        """The constraints of rows with these SamplingParams (None when no row has any);
        to_device(columns) -> tensors (Sampler._tensors: one host-to-device copy); bans: the
        step's bad-word (row, token id) pairs (bad_word_bans)."""
        allowed = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        biased = [i for i, p in enumerate(params) if p.logit_bias is not None]
        if not allowed and not biased and not bans:
            return None
        columns = {
            "allowed_rows": allowed,
            "allowed_pos": [k for k, i in enumerate(allowed) for _ in params[i].allowed_token_ids],
            "allowed_ids": [t for i in allowed for t in params[i].allowed_token_ids],
            "bias_rows": [i for i in biased for _ in params[i].logit_bias],
            "bias_ids": [t for i in biased for t in params[i].logit_bias],
            "bias_values": [v for i in biased for v in params[i].logit_bias.values()],
            "banned_rows": [row for row, _ in bans],
            "banned_ids": [token for _, token in bans],
        }
        t = to_device(columns)
        return cls(allowed_rows=t["allowed_rows"] if allowed else None,
                   allowed_index=(t["allowed_pos"], t["allowed_ids"]) if allowed else None,
                   bias_index=(t["bias_rows"], t["bias_ids"]) if biased else None,
                   bias_values=t["bias_values"] if biased else None,
                   banned_index=(t["banned_rows"], t["banned_ids"]) if bans else None)

    def apply(self, logits: torch.Tensor) -> None:
        """In place on logits [B, V] (a view of a [V, B] block's transpose works too)."""
        if self.allowed_rows is not None:
            keep = torch.zeros((self.allowed_rows.numel(), logits.shape[-1]), dtype=torch.bool,
                               device=logits.device)
            keep[self.allowed_index] = True
            logits[self.allowed_rows] = logits[self.allowed_rows].masked_fill(~keep,
                                                                             float("-inf"))
        if self.banned_index is not None:
            logits[self.banned_index] = float("-inf")
        if self.bias_index is not None:
            logits.index_put_(self.bias_index, self.bias_values.to(logits.dtype),
                              accumulate=True)


# the index columns' dtypes (Sampler.ROW_DTYPES takes these)
CONSTRAINT_DTYPES = {"allowed_rows": torch.long, "allowed_pos": torch.long,
                     "allowed_ids": torch.long, "bias_rows": torch.long, "bias_ids": torch.long,
                     "bias_values": torch.float32, "banned_rows": torch.long,
                     "banned_ids": torch.long}
