"""device.device -> the torch device, shared by the generation and embedding engines (a small
module so the embedding engine need not import the generation engine's builder)."""
from __future__ import annotations

import torch

from .errors import ConfigError


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device.device: cuda was asked for but torch sees no CUDA device; "
                          "allowed here: auto or cpu")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)
