"""The packed bidirectional attention kernel (kernels/encoder_attention.cpp) against the same
arithmetic in torch (the query times the scale and log2(e), keys, values and softmax weights
rounded to bf16; scores, softmax in base 2 and sums in fp32), and within bf16 rounding of torch's
fp32 attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchinfer.engine.kernels import load_native_kernels


def _kernel_isa() -> str:
    if not load_native_kernels() or not hasattr(torch.ops.batchinfer, "encoder_attention_isa"):
        return "none"
    return torch.ops.batchinfer.encoder_attention_isa()


needs_kernel = pytest.mark.skipif(_kernel_isa() == "none",
                                  reason="this CPU has no AVX512-BF16 (or has AMX), or no native kernels")


LOG2E = 1.44269504088896341


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _reference(q, k, v, q_starts, k_starts, heads, scale, emulate_bf16):
    """Each sequence's attention per head in torch: bf16-rounded as the kernel, or plain fp32."""
    out = torch.empty_like(q)
    dim = q.shape[1] // heads
    for b in range(len(q_starts) - 1):
        qs, ks = slice(q_starts[b], q_starts[b + 1]), slice(k_starts[b], k_starts[b + 1])
        qh, kh, vh = (x.reshape(x.shape[0], heads, dim).transpose(0, 1)
                      for x in (q[qs], k[ks], v[ks]))
        if not emulate_bf16:
            ctx = F.scaled_dot_product_attention(qh, kh, vh, scale=scale)
        else:
            # the kernel's scores are in log2 units: the query times scale x log2(e), in bf16
            scores = _bf16(qh * (scale * LOG2E)) @ _bf16(kh).transpose(1, 2)
            weights = torch.exp2(scores - scores.amax(-1, keepdim=True))
            ctx = (_bf16(weights) @ _bf16(vh)) / weights.sum(-1, keepdim=True)
        out[qs] = ctx.transpose(0, 1).reshape(-1, heads * dim)
    return out


def _packed(lengths, width, seed):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, width, generator=gen) for _ in range(3))
    starts = F.pad(torch.tensor(lengths).cumsum(0), (1, 0))
    return q, k, v, starts


@needs_kernel
@pytest.mark.parametrize("heads,dim", [(12, 32), (4, 64)])
@pytest.mark.parametrize("lengths", [[1], [16], [17, 3, 33], [256, 1, 70, 255]])
def test_every_token_attends_to_its_own_sequence(heads, dim, lengths):
    q, k, v, starts = _packed(lengths, heads * dim, sum(lengths) + dim)
    scale = dim ** -0.5
    got = torch.ops.batchinfer.encoder_attention(q, k, v, starts, starts, heads, scale)
    want = _reference(q, k, v, starts.tolist(), starts.tolist(), heads, scale, emulate_bf16=True)
    # a weight may round to the neighbouring bf16 where the kernel's exp and torch's differ by an ulp
    torch.testing.assert_close(got, want, rtol=4e-3, atol=4e-3)
    fp32 = _reference(q, k, v, starts.tolist(), starts.tolist(), heads, scale, emulate_bf16=False)
    torch.testing.assert_close(got, fp32, rtol=0.05, atol=0.05)    # bf16's 8-bit mantissa


@needs_kernel
def test_one_query_a_sequence_is_its_rows_of_the_full_attention():
    """The last layer's [CLS] rows: q_starts 0, 1, .., B against every key of each sequence."""
    lengths = [5, 40, 1, 129]
    q, k, v, starts = _packed(lengths, 384, 7)
    full = torch.ops.batchinfer.encoder_attention(q, k, v, starts, starts, 12, 0.2)
    first = starts[:-1]
    one_each = torch.arange(len(lengths) + 1)
    got = torch.ops.batchinfer.encoder_attention(q[first].contiguous(), k, v, one_each, starts, 12, 0.2)
    assert torch.equal(got, full[first])


@needs_kernel
def test_strided_rows_of_a_fused_projection():
    """q, k, v as column slices of one [tokens, 3 x width] output (the fused qkv linear)."""
    lengths = [9, 31]
    qkv = torch.randn(sum(lengths), 3 * 384)
    q, k, v = qkv.split(384, 1)
    starts = F.pad(torch.tensor(lengths).cumsum(0), (1, 0))
    got = torch.ops.batchinfer.encoder_attention(q, k, v, starts, starts, 12, 0.17)
    want = torch.ops.batchinfer.encoder_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                                  starts, starts, 12, 0.17)
    assert torch.equal(got, want)


@needs_kernel
def test_sequences_without_queries_and_an_empty_batch():
    """A sequence whose queries were all taken elsewhere (q_starts 0, 1, 1, 2) and B = 0."""
    lengths = [6, 9, 4]
    q, k, v, starts = _packed(lengths, 128, 3)
    rows = starts[[0, 2]]                                 # the first and the last sequence's [CLS]
    got = torch.ops.batchinfer.encoder_attention(q[rows].contiguous(), k, v,
                                                 torch.tensor([0, 1, 1, 2]), starts, 4, 0.3)
    full = torch.ops.batchinfer.encoder_attention(q, k, v, starts, starts, 4, 0.3)
    assert torch.equal(got, full[rows])
    empty = torch.ops.batchinfer.encoder_attention(q[:0], k[:0], v[:0], torch.tensor([0]),
                                                   torch.tensor([0]), 4, 0.3)
    assert empty.shape == (0, 128)


needs_native = pytest.mark.skipif(not load_native_kernels(), reason="native kernels did not build")


@needs_native
@pytest.mark.parametrize("starts,match", [
    ([0, 5, 3], "decreasing"),
    ([0, 2], "from 0 to the row counts"),
])
def test_bad_starts_are_refused(starts, match):
    q = k = v = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.batchinfer.encoder_attention(q, k, v, torch.tensor(starts), torch.tensor(starts),
                                               2, 1.0)


@needs_native
def test_queries_without_keys_are_refused():
    q, k = torch.randn(2, 64), torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="without keys"):
        torch.ops.batchinfer.encoder_attention(q, k, k, torch.tensor([0, 1, 2]),
                                               torch.tensor([0, 1, 1]), 2, 1.0)


@needs_native
def test_the_build_says_whether_it_has_the_kernel():
    from batchinfer.engine.host_cpu import cpu_identity

    _, flags = cpu_identity()
    isa = torch.ops.batchinfer.encoder_attention_isa()
    if flags:
        assert (isa == "avx512_bf16") == ("avx512_bf16" in flags and "amx_bf16" not in flags)
