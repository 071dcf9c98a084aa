"""Prompt log-probabilities (vLLM's `prompt_logprobs`): the model's log-probability of each prompt
token given the tokens before it, its rank, and the top k at that position, as vLLM v1 computes
them (vllm/v1/worker/gpu_model_runner.py `_get_prompt_logprobs_dict`).

While a request that asks is prefilled, the rows of its prompt positions (not the other
requests') go through the final norm and the LM head, log_softmax in fp32 over the raw logits
(before temperature, penalties, biases: vLLM's default raw mode), each position scoring the next
prompt token. A chunk's last position scores the next chunk's first token; the prompt's last
position predicts the reply and scores nothing, so a prompt of n tokens has n - 1 entries (the
first token, which nothing predicts, is None in the output). Rows go through the head a slice at
a time, so a long prompt never holds more than SLICE_ROWS x vocab logits.

The engine plans the positions of each micro-batch (`prompt_slices`, only while a request that
asks is unfinished: nothing runs for the others), the rank that holds the LM head scores them
(`score_slices`) and the engine appends the results to the sequences (`add_scores`). Positions a
sequence already scored are not planned again, so a prompt recomputed after a preemption keeps
the first scores (as vLLM). Requests that ask do not start from cached prefix blocks
(the scheduler's _match_prefix; vLLM's skip_reading_prefix_cache): every position is computed.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

# prompt rows through the LM head at once: 512 x a 49k vocabulary is 100 MB of fp32 logits
SLICE_ROWS = 512


class PromptSlice(NamedTuple):
    """Prompt positions of one batch item to score: rows first_row.. of the micro-batch's
    hidden states, each scoring the next prompt token (targets), with the top `top_k`."""

    item: int
    first_row: int
    targets: list
    top_k: int


def prompt_slices(batch) -> Optional[list[PromptSlice]]:
    """The positions of `batch` (a MicroBatch, before it runs) that score prompt tokens; None
    when no item of it asks."""
    slices = []
    row = 0
    for index, item in enumerate(batch.items):
        seq = item.seq
        top_k = seq.request.sampling.prompt_logprobs
        if top_k is not None:
            start = seq.num_computed_tokens
            first = max(start, len(seq.prompt_logprobs))    # scored before a preemption: kept
            end = min(start + item.num_tokens, seq.prompt_len - 1)
            if first < end:
                prompt = seq.request.prompt_token_ids
                slices.append(PromptSlice(index, row + first - start, prompt[first + 1:end + 1],
                                          top_k))
        row += item.num_tokens
    return slices or None


def score_slices(model, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                 slices: list, keep: bool = True) -> Optional[dict[int, dict]]:
    """Scores the planned positions from a forward's hidden states (the last stage's).
    -> {batch item: {"logprobs": [...], "ranks": [...], "top": [[(id, logprob), ...], ...]}}.
    keep=False: a tensor-parallel rank that does not report (the LM head's all-gather still
    needs every rank to run it); returns None."""
    out: dict[int, dict] = {}
    device = hidden.device
    for item, first_row, targets, top_k in slices:
        logprobs, ranks, top = [], [], []
        wanted = torch.tensor(targets, dtype=torch.long).to(device, non_blocking=True)
        for lo in range(0, len(targets), SLICE_ROWS):
            hi = min(lo + SLICE_ROWS, len(targets))
            # an index, not a slice: a copy, as the fused final norm writes in place
            rows = torch.arange(first_row + lo, first_row + hi, device=device)
            logits = model.compute_logits(hidden[rows],
                                          residual[rows] if residual is not None else None)
            if not keep:
                continue
            scores = torch.log_softmax(logits.float(), dim=-1)
            chosen = scores.gather(1, wanted[lo:hi].unsqueeze(1))
            # vLLM's rank: how many tokens score at least as high (1 = the most likely)
            ranks += (scores >= chosen).sum(dim=-1).tolist()
            logprobs += chosen.squeeze(1).tolist()
            if top_k:
                values, ids = scores.topk(top_k, dim=-1)
                top += [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            else:
                top += [[] for _ in range(hi - lo)]
        out[item] = {"logprobs": logprobs, "ranks": ranks, "top": top}
    return out if keep else None


def add_scores(batch, scores: dict[int, dict]) -> None:
    """A micro-batch's scores (score_slices') onto its sequences, in prompt order (micro-batches
    come back in the order they were launched)."""
    for index, got in scores.items():
        seq = batch.items[index].seq
        seq.prompt_logprobs.extend(zip(got["logprobs"], got["ranks"], got["top"]))
