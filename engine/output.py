"""Turns sampled tokens into finished requests: stop conditions, text, logprobs.

Stop rules follow vLLM: nothing but the length limits stops a sequence before min_tokens; then an
EOS token (unless ignore_eos), a token in stop_token_ids, or a stop string in the text of a token
after the first min_tokens (the text is cut before it unless include_stop_str_in_output, which
also keeps an EOS or stop token's own text, as vLLM's detokenizer does); max_tokens and
max_model_len give finish_reason "length". The text is what the reply's tokens add to the
prompt's, as vLLM's detokenizer (primed with the prompt) gives it; a reply cut inside a
multi-byte character ends before it (Tokenizer.decode_reply).
"""
from __future__ import annotations

from typing import Optional

from .request import FinishReason, RequestOutput, Sequence
from .tokenizer import IncrementalDetokenizer, Tokenizer, find_stop


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos = frozenset(tokenizer.eos_token_ids)
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def append(self, seq: Sequence, token: int, logprob: Optional[dict]) -> bool:
        """Appends `token`; returns True when the sequence is finished."""
        params = seq.request.sampling
        seq.output_token_ids.append(token)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        n_out = len(seq.output_token_ids)
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos:
                return self._stop(seq, FinishReason.STOP, None)
            if params.stop_token_ids and token in params.stop_token_ids:
                return self._stop(seq, FinishReason.STOP, token)
        if params.stop:
            detok = self._detok.get(seq.request_id)
            if detok is None:
                detok = self._detok[seq.request_id] = self.tokenizer.stream(
                    params.skip_special_tokens, seq.request.prompt_token_ids)
                for earlier in seq.output_token_ids[:-1]:
                    detok.add(earlier)
            chunk = detok.add(token)
            if n_out > params.min_tokens:    # the first min_tokens tokens' text cannot stop it
                hit = find_stop(detok.text, len(chunk), params.stop)
                if hit is not None:
                    stop, index = hit
                    end = index + len(stop) if params.include_stop_str_in_output else index
                    seq.text = detok.text[:end]
                    return self._stop(seq, FinishReason.STOP, stop)
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return self._stop(seq, FinishReason.LENGTH, None)
        if seq.num_tokens >= self.max_model_len:
            return self._stop(seq, FinishReason.LENGTH, None)
        return False

    def _stop(self, seq: Sequence, reason: FinishReason, stop_reason) -> bool:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        return True

    def result(self, seq: Sequence) -> RequestOutput:
        params = seq.request.sampling
        detok = self._detok.pop(seq.request_id, None)   # a stop-string request's decoder
        if not (seq.finish_reason is FinishReason.STOP and isinstance(seq.stop_reason, str)):
            ids = seq.output_token_ids
            if seq.finish_reason is FinishReason.STOP and not params.include_stop_str_in_output:
                ids = ids[:-1]   # an EOS or stop token: its id stays, its text does not (vLLM)
            if detok is not None and len(ids) == len(seq.output_token_ids):
                seq.text = detok.text      # decode_reply's stream, already fed every token
            else:
                seq.text = self.tokenizer.decode_reply(ids, params.skip_special_tokens,
                                                       seq.request.prompt_token_ids)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.request.prompt_token_ids,
            output_token_ids=list(seq.output_token_ids),
            text=seq.text,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=self._logprobs(seq) if params.logprobs is not None else None,
            prompt_logprobs=(prompt_logprob_entries(self.tokenizer, seq)
                             if params.prompt_logprobs is not None else None),
            num_preemptions=seq.num_preemptions,
            payload=seq.request.payload,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            finish_time=seq.finish_time,
        )

    def _logprobs(self, seq: Sequence) -> list[dict]:
        return [logprob_entry(self.tokenizer, token, entry["logprob"], entry["top"])
                for token, entry in zip(seq.output_token_ids, seq.output_logprobs)]


def logprob_entry(tokenizer, token_id: int, logprob: float, top) -> dict:
    """One output token's record: its id, text and bytes (Tokenizer.token_text / token_bytes),
    log-probability, and the same for each of the `top` (token id, log-probability) pairs."""
    def token(t: int, lp: float) -> dict:
        return {"token_id": t, "token": tokenizer.token_text(t),
                "bytes": list(tokenizer.token_bytes(t)), "logprob": lp}

    return {**token(token_id, logprob), "top_logprobs": [token(t, lp) for t, lp in top]}


def prompt_logprob_entries(tokenizer, seq: Sequence) -> list[Optional[dict]]:
    """The prompt's entries as vLLM's RequestOutput.prompt_logprobs lists them: None for the
    first token (nothing predicts it), then each token's logprob_entry with its rank (1: the
    most likely token at its position)."""
    prompt = seq.request.prompt_token_ids
    return [None] + [prompt_entry(tokenizer, token, logprob, rank, top)
                     for token, (logprob, rank, top) in zip(prompt[1:], seq.prompt_logprobs)]


def prompt_entry(tokenizer, token_id: int, logprob: float, rank: int, top) -> dict:
    """One prompt token's record: logprob_entry's, with the token's rank before top_logprobs."""
    entry = logprob_entry(tokenizer, token_id, logprob, top)
    top_logprobs = entry.pop("top_logprobs")
    return {**entry, "rank": rank, "top_logprobs": top_logprobs}
