"""What the dpbf16 kernel (kernels/bf16_linear.cpp) multiplies: its input rounded to bf16."""
import torch


def to_bf16(values: torch.Tensor) -> torch.Tensor:
    """values rounded to bf16 (nearest even) and widened back to their dtype."""
    return values.to(torch.bfloat16).to(values.dtype)
