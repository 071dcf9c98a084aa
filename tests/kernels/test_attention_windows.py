"""Sliding-window and logit soft-capped attention (Gemma 2 / 3) in every backend against the
per-sequence definition: ragged batches of decode rows and prefill chunks over cached prefixes
longer than the window, windows below, on and across block edges, with and without the cap."""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.attention import NativeCPUAttention, TorchAttention
from batchinfer.engine.kernels import load_native_kernels
from batchinfer.engine.torch_attention import reference_attention
from tests.paged_cases import paged_case

# (query_lens, seq_lens): decode rows and chunks, most of them far past the windows below
MIXED = ([1, 1, 7, 40, 1, 33, 1, 3], [1, 90, 7, 61, 17, 100, 130, 70])
CASES = {   # name: (heads, kv_heads, head_dim, block_size, window, softcap)
    "window-5-block-16": (4, 2, 64, 16, 5, 0.0),
    "window-16-on-the-block-edge": (8, 2, 128, 16, 16, 0.0),
    "window-37-dim-48": (6, 3, 48, 8, 37, 0.0),
    "softcap-only": (4, 1, 64, 16, 0, 0.5),
    "window-and-softcap": (4, 2, 64, 16, 24, 0.3),
}


def _case(name):
    heads, kv_heads, head_dim, block_size, window, softcap = CASES[name]
    q, kc, vc, meta = paged_case(3, head_dim, heads, kv_heads, block_size, *MIXED)
    return (q * 4, kc, vc, meta), window, softcap     # sharper scores: the cap and mask matter


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_and_native_equal_the_definition(name):
    (q, kc, vc, meta), window, softcap = _case(name)
    expected = reference_attention(q, kc, vc, meta, 0.125, window, softcap)
    plain = reference_attention(q, kc, vc, meta, 0.125)
    assert (expected - plain).abs().max() > 1e-2      # the window / cap change the output
    backends = [TorchAttention()] + ([NativeCPUAttention()] if load_native_kernels() else [])
    for backend in backends:
        got = backend.attend(q, kc, vc, meta, 0.125, window, softcap)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5, msg=backend.name)


def test_a_window_no_sequence_exceeds_is_the_plain_kernel():
    (q, kc, vc, meta), _, _ = _case("window-5-block-16")
    backends = [TorchAttention()] + ([NativeCPUAttention()] if load_native_kernels() else [])
    for backend in backends:
        plain = backend.attend(q, kc, vc, meta, 0.125)
        torch.testing.assert_close(backend.attend(q, kc, vc, meta, 0.125, 130), plain,
                                   rtol=0, atol=0 if backend.name == "native" else 2e-6)
