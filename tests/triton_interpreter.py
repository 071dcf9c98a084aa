"""Shared setup of the Triton kernel tests: without a GPU they run in Triton's CPU interpreter
(TRITON_INTERPRET=1, set before triton is first imported), which needs a triton whose interpreter
works with this numpy (3.6's breaks on numpy 2.4: its loop bounds are 1-element arrays)."""
from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")


def _version(text: str) -> tuple:
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


if not ON_GPU:
    import numpy

    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        pytest.skip(f"triton {triton.__version__}'s interpreter does not run on numpy "
                    f"{numpy.__version__} (triton 3.7+ does)", allow_module_level=True)

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
