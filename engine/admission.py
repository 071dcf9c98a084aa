"""The engine's admission rule: a prompt must fit the model (length, token ids).

`batchinfer validate` applies check_length with a tokenizer but no model; the engine applies
check_prompt when it admits a request. Problems are RequestErrors: the caller turns them into
error records and goes on.
"""
from __future__ import annotations

import numbers

from .errors import RequestError
from .request import Request


def check_length(num_tokens: int, max_model_len: int) -> None:
    """The engine's own rule, for validate (the engine checks again when it admits)."""
    if num_tokens == 0:
        raise RequestError("empty_prompt", "the prompt has no tokens")
    if num_tokens >= max_model_len:
        raise RequestError("prompt_too_long", f"the prompt has {num_tokens} tokens; max_model_len "
                           f"is {max_model_len}, which must leave room for at least one generated "
                           "token")


def check_prompt(request: Request, max_model_len: int, vocab_size: int) -> None:
    """RequestError unless the prompt fits the model: check_length's rule, and every id in the
    vocabulary (what engines check when they admit a request), and so its stop_token_ids."""
    check_prompt_ids(request.prompt_token_ids, max_model_len, vocab_size)
    check_stop_ids(request.sampling, vocab_size)


def check_stop_ids(sampling, vocab_size: int) -> None:
    """A request's stop_token_ids, logit_bias or allowed_token_ids past the vocabulary (ids it
    can never produce): a RequestError (invalid_sampling), as the engine admits it and as
    `batchinfer validate` checks it."""
    problem = sampling.token_ids_problem(vocab_size)
    if problem:
        raise RequestError("invalid_sampling", problem)


def check_prompt_ids(ids, max_model_len: int, vocab_size: int) -> None:
    """check_prompt on the token ids alone (`batchinfer validate` has no Request)."""
    kinds = set(map(type, ids))            # one pass that a tokenizer's output (ints) passes
    if kinds - {int} and any(kind is bool or not issubclass(kind, numbers.Integral)
                             for kind in kinds):
        not_ids = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        raise RequestError("bad_token_id", f"prompt token ids must be integers; got "
                           f"{', '.join(repr(t) for t in not_ids[:5])}")
    check_length(len(ids), max_model_len)
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise RequestError("bad_token_id", f"prompt token ids out of range: {bad[:5]}; this "
                           f"model's ids are 0..{vocab_size - 1}")


def check_lora(request: Request, adapters) -> None:
    """Sets the request's LoRA adapter slot (its index in model.lora_modules + 1; 0: none);
    RequestError naming the key and the adapters there are for a name not among them."""
    if request.lora is None:
        request.lora_slot = 0
        return
    names = list(adapters or ())
    if not isinstance(request.lora, str) or request.lora not in names:
        known = ", ".join(repr(n) for n in names) if names else "none (model.lora_modules is empty)"
        raise RequestError("unknown_lora", f"lora: {request.lora!r} is not a LoRA adapter of "
                           f"this job; the adapters are {known}")
    request.lora_slot = names.index(request.lora) + 1
