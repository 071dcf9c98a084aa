"""Sliding-window and logit soft-capped attention (Gemma 2 / 3) in every backend against the
per-sequence definition: ragged batches of decode rows and prefill chunks over cached prefixes
longer than the window, windows below, on and across block edges, with and without the cap."""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.torch_attention import reference_attention
from tests.paged_cases import KERNEL_CASES, cpu_backends, kernel_case

CASES = sorted(name for name in KERNEL_CASES if not name.startswith("sinks"))


@pytest.mark.parametrize("name", CASES)
def test_torch_and_native_equal_the_definition(name):
    q, kc, vc, meta, window, softcap = kernel_case(name)
    expected = reference_attention(q, kc, vc, meta, 0.125, window, softcap)
    plain = reference_attention(q, kc, vc, meta, 0.125)
    assert (expected - plain).abs().max() > 1e-2      # the window / cap change the output
    for backend in cpu_backends():
        got = backend.attend(q, kc, vc, meta, 0.125, window, softcap)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5, msg=backend.name)


def test_a_window_no_sequence_exceeds_is_the_plain_kernel():
    q, kc, vc, meta, _, _ = kernel_case("window-5-block-16")
    for backend in cpu_backends():
        plain = backend.attend(q, kc, vc, meta, 0.125)
        torch.testing.assert_close(backend.attend(q, kc, vc, meta, 0.125, 130), plain,
                                   rtol=0, atol=0 if backend.name == "native" else 2e-6)
