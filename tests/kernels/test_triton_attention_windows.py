"""The Triton paged kernel's sliding window and logit soft-cap (Gemma 2 / 3) against the
per-sequence definition; in Triton's interpreter without a GPU (tests/triton_interpreter.py)."""
from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import DEVICE  # first: the interpreter's setup
from batchinfer.engine.attention import AttentionMetadata  # noqa: E402
from batchinfer.engine.torch_attention import reference_attention  # noqa: E402
from batchinfer.engine.triton_attention import TritonAttention  # noqa: E402
from tests.paged_cases import paged_case  # noqa: E402

MIXED = ([1, 1, 7, 40, 1, 3], [1, 90, 7, 61, 17, 70])   # short: the interpreter is slow


@pytest.mark.parametrize("window,softcap,block_size", [(5, 0.0, 16), (16, 0.0, 16), (37, 0.0, 8),
                                                       (0, 0.5, 16), (24, 0.3, 16)])
def test_window_and_softcap_equal_the_definition(window, softcap, block_size):
    q, kc, vc, meta = paged_case(3, 32, 4, 2, block_size, *MIXED)
    q = q * 4
    expected = reference_attention(q, kc, vc, meta, 0.125, window, softcap)
    moved = AttentionMetadata.build(meta.query_lens_cpu, meta.seq_lens_cpu,
                                    meta.block_tables.tolist(), block_size, DEVICE)
    got = TritonAttention().attend(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), moved, 0.125,
                                   window, softcap)
    torch.testing.assert_close(got.cpu(), expected, rtol=2e-5, atol=2e-5)
