"""The int8 linears (engine/model/int8_linear.py, kernels/int8_linear.cpp) against an int64
reference of the same quantized maths: codes bit for bit, outputs to fp32 rounding."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.engine.model.fast_linear import BlockedLinear, pack_linears
from batchinfer.engine.model.int8_linear import (BLOCK, Int8Linear, LinearQuantization,
                                                 int8_kernel_available, quantize_rows,
                                                 quantize_weight)

needs_vnni = pytest.mark.skipif(not int8_kernel_available(),
                                reason="this CPU has no AVX512-VNNI (or no native kernels)")


def _inputs(rows: int, in_features: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen) * 3
    x[:, min(5, in_features - 1)] *= 40          # an outlier channel, as real activations have
    if rows > 2:
        x[1] = 0.0                               # a zero row: scale 0, codes 0
    return x


def _reference(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """sum over 64-channel blocks of x_scale x (codes . codes) in int64, times the weight scale."""
    codes, x_scale = quantize_rows(x)
    w_codes, w_scale = quantize_weight(linear.weight)
    rows, kp = codes.shape
    w_padded = F.pad(w_codes, (0, kp - w_codes.shape[1])).long()
    sums = torch.einsum("mbk,nbk->mbn", codes.long().reshape(rows, -1, BLOCK),
                        w_padded.reshape(w_padded.shape[0], -1, BLOCK)).double()
    y = (sums * x_scale.double()[:, :, None]).sum(1) * w_scale.double()[None, :]
    if linear.bias is not None:
        y = y + linear.bias.detach().double()
    return y


def _same_codes(x: torch.Tensor) -> None:
    codes, scales = torch.ops.batchinfer.int8_quantize_rows(x)
    want_codes, want_scales = quantize_rows(x)
    assert codes.dtype == torch.uint8 and codes.shape[1] % BLOCK == 0
    assert torch.equal(codes.to(torch.int16) - 128, want_codes.to(torch.int16))
    torch.testing.assert_close(scales, want_scales, rtol=0, atol=0, equal_nan=True)


@needs_vnni
@pytest.mark.parametrize("rows,in_features", [(1, 576), (7, 3), (13, 577), (50, 64), (131, 1536)])
def test_kernel_codes_and_scales_are_torchs_bit_for_bit(rows, in_features):
    _same_codes(_inputs(rows, in_features, rows))


@needs_vnni
def test_codes_round_with_a_true_division_as_the_kernel_does():
    """127 / absmax as one division: torch's `127.0 / tensor` is reciprocal-then-multiply, which
    put this block's second value on the other side of a rounding boundary."""
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1] = 3.7, 0.01456693
    _same_codes(x)
    codes, _ = quantize_rows(x)
    assert int(codes[0, 1]) == 1
    _same_codes(torch.randn(512, 1024) * torch.rand(512, 1) * 10)


@needs_vnni
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 48, 49, 131])
@pytest.mark.parametrize("out_features,in_features,bias", [(960, 576, False), (48, 577, True),
                                                           (16, 3, True), (80, 100, False)])
def test_kernel_equals_the_int64_reference(rows, out_features, in_features, bias):
    torch.manual_seed(rows + out_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    x = _inputs(rows, in_features, rows + 1)
    got = Int8Linear(linear)(x).double()
    want = _reference(x, linear)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    # and near the fp32 linear it stands for (the quantization's own error)
    exact = linear(x)
    assert (got.float() - exact).abs().max() <= 0.05 * exact.abs().max()


@needs_vnni
@pytest.mark.parametrize("bias", [False, True])
def test_fused_silu_mul_is_silu_of_gate_times_up(bias):
    torch.manual_seed(3)
    gate_up = nn.Linear(576, 2 * 96, bias=bias)
    x = _inputs(37, 576, 4)
    layer = Int8Linear(gate_up)
    assert layer.can_fuse_silu_mul
    gate, up = _reference(x, gate_up).float().chunk(2, dim=-1)
    torch.testing.assert_close(layer.silu_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    gate_k, up_k = layer(x).chunk(2, dim=-1)
    torch.testing.assert_close(layer.silu_mul(x), F.silu(gate_k) * up_k, rtol=1e-5, atol=1e-5)


@needs_vnni
@pytest.mark.parametrize("out_features", [1536, 48])     # whole panel pairs; a lone last panel
def test_fused_gelu_is_the_exact_gelu_of_the_output(out_features):
    torch.manual_seed(5)
    linear = nn.Linear(384, out_features)
    layer = Int8Linear(linear)
    x = _inputs(29, 384, 6)
    plain = layer(x)
    assert plain.max() > 6 and plain.min() < -6       # the erf's tails are reached, both signs
    torch.testing.assert_close(layer.gelu(x), F.gelu(plain), rtol=2e-6, atol=3e-6)
    torch.testing.assert_close(layer.gelu(x), F.gelu(_reference(x, linear).float()),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="silu_mul or gelu"):
        torch.ops.batchinfer.int8_linear(x, layer.packed, layer.scale, layer.comp, layer.bias,
                                         True, True)


@needs_vnni
def test_a_rows_result_does_not_depend_on_its_batch():
    """Integer sums and a per-row epilogue: bitwise the same alone, in any tile or row block and
    under any thread split."""
    torch.manual_seed(9)
    layer = Int8Linear(nn.Linear(576, 976, bias=False))      # 61 panels: an odd one at the end
    x = _inputs(131, 576, 10)
    full = layer(x)
    for start, stop in [(0, 1), (5, 6), (48, 53), (100, 131), (3, 97)]:
        assert torch.equal(layer(x[start:stop]), full[start:stop]), (start, stop)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):     # explicit counts: a test process may have one CPU (xdist)
            torch.set_num_threads(n)
            assert torch.equal(layer(x), full), n
    finally:
        torch.set_num_threads(threads)


@needs_vnni
def test_a_nan_reaches_the_outputs_of_its_row_only():
    layer = Int8Linear(nn.Linear(128, 32, bias=False))
    x = _inputs(9, 128, 5)
    clean = layer(x)
    x[4, 70] = float("nan")
    got = layer(x)
    assert torch.isnan(got[4]).all()
    assert torch.equal(got[torch.arange(9) != 4], clean[torch.arange(9) != 4])
    _same_codes(x)


def test_dense_weight_is_the_codes_times_their_scales():
    linear = nn.Linear(100, 32, bias=False)
    codes, scale = quantize_weight(linear.weight)
    torch.testing.assert_close(Int8Linear(linear).dense_weight(), codes.float() * scale[:, None])
    assert (codes.abs() <= 127).all() and (codes.abs().amax(dim=1) == 127).all()


@pytest.mark.parametrize("lm_head", [False, True])
def test_pack_linears_quantizes_the_panel_widths_and_the_lm_head_only_if_asked(lm_head):
    model = nn.Module()
    model.proj = nn.Linear(64, 48)
    model.odd = nn.Linear(64, 40)                       # not whole panels: the fp32 path
    model.router = nn.Linear(64, 32, bias=False)
    model.router.quantizable = False                    # as the MoE routers are marked
    model.lm_head = nn.Linear(64, 32, bias=False)
    pack_linears(model, quantization=LinearQuantization("int8", lm_head))
    assert isinstance(model.proj, Int8Linear) and not isinstance(model.odd, Int8Linear)
    assert not isinstance(model.router, Int8Linear)
    assert isinstance(model.lm_head, Int8Linear) == lm_head
    if not lm_head and isinstance(model.lm_head, BlockedLinear):
        assert model.lm_head.blocked.dtype == torch.float32
