"""Attention sinks (GPT-OSS: a learned logit per head that joins each query's softmax denominator
and takes no value) in the torch path, the native CPU kernel and the CUDA graphs' decode
attention, against the definition written out here (each sequence, each head: softmax over the
visible scores and the sink, the sink's share dropped), alone and with a sliding window and a
soft-cap; and a layer without sinks keeps the plain kernel's exact output. The Triton kernel's
sinks are in test_triton_attention_windows.py (its interpreter)."""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.attention import NativeCPUAttention
from batchinfer.engine.kernels import load_native_kernels
from batchinfer.engine.torch_attention import decode_attention, reference_attention
from tests.paged_cases import KERNEL_CASES, cpu_backends, kernel_case

CASES = sorted(name for name in KERNEL_CASES if name.startswith("sinks"))


def sink_definition(q, kc, vc, meta, scale, sinks, window=0, softcap=0.0):
    """Each sequence, each head, straight from the definition."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, block_size = kc.shape[1], kc.shape[2]
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        blocks = meta.block_tables[i, :-(-s_len // block_size)].long()
        k = kc[blocks].transpose(0, 1).reshape(kv_heads, -1, dim)[:, :s_len].float()
        v = vc[blocks].transpose(0, 1).reshape(kv_heads, -1, dim)[:, :s_len].float()
        for j in range(q_len):
            at = s_len - q_len + j
            lo = max(0, at + 1 - window) if window else 0
            for h in range(heads):
                kv = h // (heads // kv_heads)
                scores = (k[kv, lo:at + 1] @ q[start + j, h]) * scale
                if softcap:
                    scores = torch.tanh(scores / softcap) * softcap
                probs = torch.softmax(torch.cat((scores, sinks[h:h + 1])), 0)[:-1]
                out[start + j, h] = probs @ v[kv, lo:at + 1]
        start += q_len
    return out


def _case(name, seed=3):
    q, kc, vc, meta, window, softcap = kernel_case(name, seed)
    # sinks from well below to well above the scores, so they take from nothing to most of a row
    sinks = torch.linspace(-3.0, 4.0, q.shape[1])
    return q, kc, vc, meta, sinks, window, softcap


@pytest.mark.parametrize("name", CASES)
def test_sinks_equal_the_definition(name):
    q, kc, vc, meta, sinks, window, softcap = _case(name)
    expected = sink_definition(q, kc, vc, meta, 0.125, sinks, window, softcap)
    without = reference_attention(q, kc, vc, meta, 0.125, window, softcap)
    assert (expected - without).abs().max() > 0.1           # the sinks change the output
    torch.testing.assert_close(reference_attention(q, kc, vc, meta, 0.125, window, softcap, sinks),
                               expected, rtol=2e-5, atol=2e-5)
    for backend in cpu_backends():
        got = backend.attend(q, kc, vc, meta, 0.125, window, softcap, sinks=sinks)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5, msg=backend.name)


def test_without_sinks_the_kernels_give_their_plain_output_exactly():
    """sinks=None is the path a model without sinks takes: bit for bit the call without the
    argument (the native kernel's AVX2 paths included)."""
    q, kc, vc, meta, _, _, _ = _case("sinks")
    for backend in cpu_backends():
        plain = backend.attend(q, kc, vc, meta, 0.125)
        assert torch.equal(backend.attend(q, kc, vc, meta, 0.125, 0, 0.0, sinks=None), plain)


def test_the_cuda_graphs_decode_attention_takes_the_sinks():
    """decode_attention (what the CUDA graphs capture on the torch path): one query per row over
    padded tables under a length mask, the query heads of a kv head grouped."""
    q, kc, vc, meta, sinks, _, _ = _case("sinks-dim-128-gqa-4")
    rows = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
    starts = torch.tensor(meta.query_lens_cpu).cumsum(0) - 1
    block_size = kc.shape[2]
    keys = meta.block_tables.shape[1] * block_size
    lens = meta.seq_lens[rows].long()
    mask = (torch.arange(keys)[None, :] < lens[:, None])[:, None, None, :]
    got = decode_attention(q[starts[rows]], kc, vc, meta.block_tables[rows].long(), mask, 0.125,
                           sinks=sinks)
    expected = sink_definition(q, kc, vc, meta, 0.125, sinks)[starts[rows]]
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_a_wrong_sinks_tensor_is_refused_by_the_native_kernel():
    if not load_native_kernels():
        pytest.skip("the native kernels are not built here")
    q, kc, vc, meta, sinks, _, _ = _case("sinks")
    with pytest.raises(RuntimeError, match=r"sinks must be float32 \[4\]"):
        NativeCPUAttention().attend(q, kc, vc, meta, 0.125, sinks=sinks[:3])
