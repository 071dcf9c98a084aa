"""Per-request constraints on which tokens a step samples, as vLLM's built-in logits processors
apply them: `allowed_token_ids` (every other token's logit to -inf) and `logit_bias` (a number
added to some tokens' logits). Both come before the penalties and the sampling filters, after the
raw log-probabilities are read (logprobs report the model's distribution, as vLLM's default
`raw_logprobs` mode does).

Built once per step from the rows' SamplingParams into index tensors, so applying them is two
tensor ops whatever the batch holds (no per-request Python in the step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


@dataclass
class TokenConstraints:
    allowed_rows: Optional[torch.Tensor] = None    # [A] rows with allowed_token_ids
    allowed_index: Optional[tuple] = None          # (position in allowed_rows, token id) pairs
    bias_index: Optional[tuple] = None             # (row, token id) pairs
    bias_values: Optional[torch.Tensor] = None     # [N] float32, one per pair

    @classmethod
    def of(cls, params: Sequence, to_device: Callable[[dict], dict]) -> Optional["TokenConstraints"]:
        """The constraints of rows with these SamplingParams (None when no row has any);
        to_device(columns) -> tensors (Sampler._tensors: one host-to-device copy)."""
        allowed = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        biased = [i for i, p in enumerate(params) if p.logit_bias is not None]
        if not allowed and not biased:
            return None
        columns = {
            "allowed_rows": allowed,
            "allowed_pos": [k for k, i in enumerate(allowed) for _ in params[i].allowed_token_ids],
            "allowed_ids": [t for i in allowed for t in params[i].allowed_token_ids],
            "bias_rows": [i for i in biased for _ in params[i].logit_bias],
            "bias_ids": [t for i in biased for t in params[i].logit_bias],
            "bias_values": [v for i in biased for v in params[i].logit_bias.values()],
        }
        t = to_device(columns)
        return cls(allowed_rows=t["allowed_rows"] if allowed else None,
                   allowed_index=(t["allowed_pos"], t["allowed_ids"]) if allowed else None,
                   bias_index=(t["bias_rows"], t["bias_ids"]) if biased else None,
                   bias_values=t["bias_values"] if biased else None)

    def apply(self, logits: torch.Tensor) -> None:
        """In place on logits [B, V] (a view of a [V, B] block's transpose works too)."""
        if self.allowed_rows is not None:
            keep = torch.zeros((self.allowed_rows.numel(), logits.shape[-1]), dtype=torch.bool,
                               device=logits.device)
            keep[self.allowed_index] = True
            logits[self.allowed_rows] = logits[self.allowed_rows].masked_fill(~keep,
                                                                             float("-inf"))
        if self.bias_index is not None:
            logits.index_put_(self.bias_index, self.bias_values.to(logits.dtype),
                              accumulate=True)


# the index columns' dtypes (Sampler.ROW_DTYPES takes these)
CONSTRAINT_DTYPES = {"allowed_rows": torch.long, "allowed_pos": torch.long,
                     "allowed_ids": torch.long, "bias_rows": torch.long, "bias_ids": torch.long,
                     "bias_values": torch.float32}
