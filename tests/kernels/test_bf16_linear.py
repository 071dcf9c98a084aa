"""The native bf16 linears: dpbf16 (kernels/bf16_linear.cpp, fast_linear.PairedBf16Linear:
AVX512-BF16 dot products) and amx (kernels/amx_linear.cpp, fast_linear.AmxBf16Linear: AMX-BF16
tiles), both over bf16 weights in panels of k pairs, the input rounded to bf16 in the kernel, fp32
sums. Checked against fp64 sums of the same rounded operands, and for the properties the engine
relies on: a row's result does not depend on its batch, the fused SiLU epilogue equals the two
ops. Each kernel's tests run only where the CPU (and the kernels' build) has its instructions."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from batchinfer.engine.model.fast_linear import (AmxBf16Linear, PairedBf16Linear, amx_available,
                                                 bf16_dot_available, from_bf16_pairs,
                                                 to_bf16_pairs)

needs_bf16_dot = pytest.mark.skipif(not bf16_dot_available(),
                                    reason="this CPU (or the kernels' build) has no AVX512-BF16")
# each native kernel's module, skipped where the CPU or the build lacks its instructions
KERNELS = [
    pytest.param(PairedBf16Linear, id="dpbf16", marks=needs_bf16_dot),
    pytest.param(AmxBf16Linear, id="amx", marks=pytest.mark.skipif(
        not amx_available(), reason="this CPU (or the kernels' build, or Linux) gives no AMX-BF16")),
]


def _linear(out_features: int, in_features: int, seed: int, bias: bool = False) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def _inputs(rows: int, in_features: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    x[:, min(3, in_features - 1)] *= 50          # an outlier channel, as real activations have
    return x


def _reference(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """The same rounded operands (input and weight to bf16) summed in fp64."""
    y = x.to(torch.bfloat16).double() @ linear.weight.detach().to(torch.bfloat16).double().T
    return y if linear.bias is None else y + linear.bias.detach().double()


@pytest.mark.parametrize("out_features,in_features", [(16, 3), (48, 577), (96, 576), (576, 1536)])
def test_pairs_layout_round_trips_and_pads_odd_widths_with_zero(out_features, in_features):
    weight = torch.randn(out_features, in_features)
    pairs = to_bf16_pairs(weight)
    assert pairs.shape == (out_features // 16, (in_features + 1) // 2, 16, 2)
    assert pairs.dtype == torch.bfloat16
    assert torch.equal(from_bf16_pairs(pairs, in_features), weight.to(torch.bfloat16))
    # panel p, k pair g, column c holds (w[16 p + c][2 g], w[16 p + c][2 g + 1])
    panel = 1 if out_features > 16 else 0
    assert torch.equal(pairs[panel, 0, 5], weight.to(torch.bfloat16)[16 * panel + 5, 0:2])
    if in_features % 2:
        assert torch.all(pairs[:, -1, :, 1] == 0)
    stacked = to_bf16_pairs(torch.stack([weight, 2 * weight]))   # MoE experts: a leading dim
    assert torch.equal(stacked[1], to_bf16_pairs(2 * weight))
    tiles = to_bf16_pairs(weight, k_multiple=32)                  # the amx kernel's: k to 32
    assert tiles.shape == (out_features // 16, -(-in_features // 32) * 16, 16, 2)
    assert torch.equal(from_bf16_pairs(tiles, in_features), weight.to(torch.bfloat16))
    assert torch.all(tiles[:, pairs.shape[1]:] == 0) and torch.equal(tiles[:, :pairs.shape[1], :, 0],
                                                                     pairs[..., 0])


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 6, 8, 12, 13, 16, 17, 33, 48, 50, 131])
@pytest.mark.parametrize("out_features,in_features",
                         [(16, 64), (48, 577), (96, 576), (112, 130), (960, 576)])
def test_outputs_match_fp64_sums_of_the_rounded_operands(kind, rows, out_features, in_features):
    """Every tile height (dpbf16: 6 rows x 4 panels, a last group of 3, 2 or 1 panels at 8, 12
    or 12 rows, row blocks of 48; amx: 16 or 32 rows, padded, row blocks of 128), odd panel
    counts (48: three; 112: four and three) and an odd K (577: zeros pad the last pair, or the
    last tile step)."""
    linear = _linear(out_features, in_features, seed=rows)
    x = _inputs(rows, in_features, seed=rows + 1)
    with torch.no_grad():
        ours = kind(linear)(x)
    reference = _reference(x, linear)
    scale = reference.abs().max()
    assert ours.dtype == torch.float32 and ours.shape == (rows, out_features)
    # fp32 sums over up to 577 products: a few ulps of the largest partial sums
    assert ((ours.double() - reference).abs().max() / scale) < 1e-5


@pytest.mark.parametrize("kind", KERNELS)
def test_bias_and_leading_dimensions(kind):
    linear = _linear(48, 70, seed=3, bias=True)      # three panels: the lone last one has bias too
    x = _inputs(6, 70, seed=4).reshape(2, 3, 70)
    with torch.no_grad():
        ours = kind(linear)(x)
    assert ours.shape == (2, 3, 48)
    reference = _reference(x.reshape(6, 70), linear).reshape(2, 3, 48)
    assert ((ours.double() - reference).abs().max() / reference.abs().max()) < 1e-5


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("out_features", [96, 144])
def test_a_row_gives_the_same_bits_in_any_batch_and_any_thread_count(kind, out_features):
    """144 columns: nine panels, three column groups for dpbf16, which two or three threads
    split inside a group's rows."""
    linear = kind(_linear(out_features, 576, seed=5))
    x = _inputs(300, 576, seed=6)
    threads = torch.get_num_threads()
    with torch.no_grad():
        batched = linear(x)
        for row in (0, 11, 12, 15, 16, 31, 47, 48, 127, 128, 130, 299):
            assert torch.equal(linear(x[row:row + 1]), batched[row:row + 1])
        assert torch.equal(linear(x[40:60]), batched[40:60])
        try:
            for count in (1, 2, 3):
                torch.set_num_threads(count)
                assert torch.equal(linear(x), batched)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("rows", [1, 13, 50, 140])
@pytest.mark.parametrize("width", [96, 48])
def test_fused_silu_mul_equals_the_gemm_then_silu_and_mul(kind, rows, width):
    """The epilogue uses the fp32 kernels' SiLU (kernels/simd.h), as the native silu_and_mul op
    does: the same bits as the two ops. Width 48: three gate panels (dpbf16: a group of two gate
    and two up panels, then one of each)."""
    linear = kind(_linear(2 * width, 576, seed=7))
    x = _inputs(rows, 576, seed=8)
    assert linear.can_fuse_silu_mul
    with torch.no_grad():
        fused = linear.silu_mul(x)
        unfused = torch.ops.batchinfer.silu_and_mul(linear(x))
    assert fused.shape == (rows, width)
    assert torch.equal(fused, unfused)


@pytest.mark.parametrize("kind", KERNELS)
def test_nan_reaches_the_outputs_it_touches(kind):
    linear = kind(_linear(32, 64, seed=9))
    x = _inputs(3, 64, seed=10)
    x[1, 7] = float("nan")
    with torch.no_grad():
        y = linear(x)
    assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2]]).any()


@pytest.mark.parametrize("kind", KERNELS)
def test_pack_linears_swaps_panel_widths_and_leaves_the_rest_to_onednn(kind, monkeypatch):
    from batchinfer.engine.model import fast_linear

    monkeypatch.setenv("BATCHINFER_BF16_LINEAR_KERNEL",
                       "amx" if kind is AmxBf16Linear else "dpbf16")
    model = nn.ModuleDict({"panel": nn.Linear(64, 48, bias=False), "odd": nn.Linear(64, 40)})
    assert fast_linear.pack_linears(model, weight_dtype=torch.bfloat16) == 2
    assert type(model["panel"]) is kind
    assert isinstance(model["odd"], fast_linear.PackedLinear) and model["odd"].weight_dtype == torch.bfloat16


def test_an_unknown_bf16_kernel_is_refused_with_the_choices(monkeypatch):
    from batchinfer.engine.model import fast_linear

    monkeypatch.setenv("BATCHINFER_BF16_LINEAR_KERNEL", "tiles")
    with pytest.raises(ValueError, match="'tiles'.*auto, amx, dpbf16, onednn, blocked, torch"):
        fast_linear.bf16_linear_kernel()


def test_auto_takes_amx_where_the_cpu_has_it_and_dpbf16_only_without_it(monkeypatch):
    from batchinfer.engine import cpu_dtype
    from batchinfer.engine.model import fast_linear

    monkeypatch.delenv("BATCHINFER_BF16_LINEAR_KERNEL", raising=False)
    monkeypatch.setattr(cpu_dtype, "native_bf16_flags", lambda: ("amx_bf16", "avx512_bf16"))
    assert fast_linear.bf16_linear_kernel() in ("amx" if amx_available() else "onednn", "torch")
    monkeypatch.setattr(cpu_dtype, "native_bf16_flags", lambda: ("avx512_bf16",))
    expected = "dpbf16" if bf16_dot_available() else "onednn"
    assert fast_linear.bf16_linear_kernel() in (expected, "torch")
    monkeypatch.setattr(cpu_dtype, "native_bf16_flags", lambda: ())
    assert fast_linear.bf16_linear_kernel() in ("blocked", "torch")


@pytest.mark.skipif(not hasattr(torch.ops.batchinfer, "amx_bf16_isa"),
                    reason="the native kernels are not built here")
def test_amx_refuses_pairs_packed_for_another_k():
    """The amx kernel steps k by 32: pairs padded only to an even k (dpbf16's) are refused, on
    any CPU (the check comes before the tiles are asked for)."""
    weight = torch.randn(32, 70)
    with pytest.raises(RuntimeError, match="packed for another K"):
        torch.ops.batchinfer.amx_linear(torch.randn(2, 70), to_bf16_pairs(weight), None)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        torch.ops.batchinfer.amx_linear(torch.randn(2, 70, dtype=torch.bfloat16),
                                        to_bf16_pairs(weight, k_multiple=32), None)
