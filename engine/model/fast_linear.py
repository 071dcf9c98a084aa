"""Faster fp32 linears on CPU: weights pre-packed once for oneDNN.

torch's default CPU linear re-packs the weight matrix on every call; at decode batch sizes
(tens to hundreds of rows) that costs as much as the multiply. Packing once at load time and
calling oneDNN's linear directly measured 1.2-1.7x faster per GEMM on the model's shapes at
M = 7..300 on this 2-core AVX2 machine (benchmarks/gemm_roofline.py). Elsewhere (CUDA, bf16, no
oneDNN) the module is left as it is.
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger(__name__)
PACK_BATCH_HINT = 128


def onednn_available() -> bool:
    """BATCHINFER_PACK_LINEARS=0 turns packing off (plain torch linears everywhere)."""
    if os.environ.get("BATCHINFER_PACK_LINEARS", "1") == "0":
        return False
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """A Linear whose weight lives in oneDNN's blocked layout (same maths, same parameters)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Swaps every fp32 CPU nn.Linear in `model` for a PackedLinear; returns how many."""
    if not onednn_available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.device.type == "cpu"
                    and child.weight.dtype == torch.float32):
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped
