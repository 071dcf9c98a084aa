"""From a padded batch's last hidden states to each input's embedding, as vLLM's embedding
pooler computes it: pool (CLS / LAST / MEAN over the input's own tokens) in fp32, keep the first
`dimensions` (matryoshka), then L2-normalize when use_activation (vLLM's EmbeddingPoolerHead:
truncation first, so a shortened embedding has unit length)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, lengths: list[int], pooling_type: str) -> torch.Tensor:
    """hidden: [rows, padded length, hidden], each row's tokens first (right padding);
    -> [rows, hidden] in fp32."""
    hidden = hidden.float()
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if pooling_type == "CLS":
        return hidden[:, 0]
    if pooling_type == "LAST":
        last = torch.tensor([n - 1 for n in lengths], device=hidden.device)
        return hidden[rows, last]
    if pooling_type == "MEAN":
        positions = torch.arange(hidden.shape[1], device=hidden.device)
        counts = torch.tensor(lengths, device=hidden.device)
        mask = (positions[None, :] < counts[:, None]).to(hidden.dtype)
        return (hidden * mask[..., None]).sum(dim=1) / counts[:, None].to(hidden.dtype)
    raise ValueError(f"unknown pooling type {pooling_type!r}")


def finish(pooled: torch.Tensor, dimensions: list[Optional[int]],
           normalize: list[bool]) -> list[list[float]]:
    """Per row: its first `dimensions` values (None: all), L2-normalized where `normalize`."""
    out = []
    for row, dims, norm in zip(pooled, dimensions, normalize):
        vec = row[:dims] if dims is not None else row
        if norm:
            vec = F.normalize(vec, p=2, dim=-1)
        out.append(vec.tolist())
    return out
