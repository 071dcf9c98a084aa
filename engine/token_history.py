"""Each penalised request's prompt and output token ids as int64 arrays, kept across steps.

The penalties need every row's prompt and output tokens as padded [rows, longest] tensors each
step. Converting the Python lists anew with torch.tensor costs ~79 ns a token (13.3 ms of host
work at 128 rows of 1,300 tokens on the project's CPU, benchmarks/sim/host_costs.py); here the prompt
is converted once and the output extended by the tokens new since the last step, so a step
copies arrays (1.5-1.8 ms there). A row belongs to one Request object: a request id seen again
with another request (an id reused without release) starts a new row.
"""
from __future__ import annotations

import numpy as np
import torch

from .host_to_device import to_device
from .request import Sequence


class _Row:
    def __init__(self, request, prompt: list[int]):
        self.request = request
        self.prompt = np.asarray(prompt, dtype=np.int64)
        self.output = np.empty(64, dtype=np.int64)
        self.length = 0

    def matches(self, outputs: list[int]) -> bool:
        """The kept outputs are a prefix of `outputs` (their last token is checked)."""
        n = self.length
        return n <= len(outputs) and (n == 0 or self.output[n - 1] == outputs[n - 1])

    def extend(self, outputs: list[int]) -> None:
        new = len(outputs) - self.length
        if new <= 0:
            return
        if len(outputs) > len(self.output):
            grown = np.empty(max(len(outputs), 2 * len(self.output)), dtype=np.int64)
            grown[:self.length] = self.output[:self.length]
            self.output = grown
        self.output[self.length:len(outputs)] = outputs[self.length:]
        self.length = len(outputs)


class TokenHistory:
    def __init__(self) -> None:
        self._rows: dict[str, _Row] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def release(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def _row(self, seq: Sequence) -> _Row:
        row = self._rows.get(seq.request_id)
        outputs = seq.output_token_ids
        if row is None or row.request is not seq.request or not row.matches(outputs):
            row = self._rows[seq.request_id] = _Row(seq.request, seq.request.prompt_token_ids)
        row.extend(outputs)
        return row

    def padded(self, seqs: list[Sequence], pad: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt tokens, output tokens) of `seqs`, each [len(seqs), longest or 1] int64 padded
        with `pad`."""
        rows = [self._row(s) for s in seqs]
        prompt = np.full((len(rows), max((len(r.prompt) for r in rows), default=0) or 1), pad,
                         dtype=np.int64)
        output = np.full((len(rows), max((r.length for r in rows), default=0) or 1), pad,
                         dtype=np.int64)
        for i, row in enumerate(rows):
            prompt[i, :len(row.prompt)] = row.prompt
            output[i, :row.length] = row.output[:row.length]
        return (to_device(torch.from_numpy(prompt), device),
                to_device(torch.from_numpy(output), device))
