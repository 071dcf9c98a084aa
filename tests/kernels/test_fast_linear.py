"""The engine's CPU linear kernels (engine/model/fast_linear.py) against torch's linear: fp32,
and bf16 weights under fp32 activations."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from batchinfer.engine.model import fast_linear
from batchinfer.engine.model.fast_linear import (BlockedLinear, PackedLinear, RoundedWeightLinear,
                                                 blocked_kernel_available, linear_kernel, pack_linears,
                                                 to_blocked)

needs_blocked = pytest.mark.skipif(not blocked_kernel_available(), reason="native CPU kernels unavailable")


@needs_blocked
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 47, 48, 49, 64, 100, 130])
@pytest.mark.parametrize("out_features,in_features", [(48, 40), (96, 576), (32, 3)])
def test_blocked_kernel_equals_torch_linear(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    got = torch.ops.batchinfer.blocked_linear(x, to_blocked(w).contiguous())
    torch.testing.assert_close(got, nn.functional.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_blocked
def test_a_rows_result_does_not_depend_on_its_batch():
    """Every output is one FMA chain over k in order: bitwise the same alone, in any tile size,
    in any row block and under any thread split."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(131, 576, generator=gen)
    w = to_blocked(torch.randn(960, 576, generator=gen)).contiguous()
    full = torch.ops.batchinfer.blocked_linear(x, w)
    for start, stop in [(0, 1), (5, 6), (48, 53), (100, 131), (3, 97)]:
        part = torch.ops.batchinfer.blocked_linear(x[start:stop], w)
        assert torch.equal(part, full[start:stop]), (start, stop)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):     # explicit counts: a test process may have one CPU (xdist)
            torch.set_num_threads(n)
            assert torch.equal(torch.ops.batchinfer.blocked_linear(x, w), full), n
    finally:
        torch.set_num_threads(threads)


@needs_blocked
@pytest.mark.parametrize("switch", [{"prefetch": False}, {"wide": False},
                                    {"prefetch": False, "wide": False}])
def test_kernel_switches_leave_every_result_bitwise_the_same(switch):
    """prefetch=False turns the next-panel prefetch off, wide=False the AVX-512 tile (the ops'
    arguments, BlockedLinear.prefetch / .wide): the products are the same bits either way, at one
    tile, several tiles and several row blocks, with an odd panel count, fused SiLU-and-mul too."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(131, 576, generator=gen)
    w = to_blocked(torch.randn(976, 576, generator=gen)).contiguous()      # 61 panels
    gate_up = to_blocked(torch.randn(192, 576, generator=gen)).contiguous()
    ops = torch.ops.batchinfer
    args = (switch.get("prefetch", True), switch.get("wide", True))
    for rows in (5, 16, 131):
        assert torch.equal(ops.blocked_linear(x[:rows], w, *args), ops.blocked_linear(x[:rows], w)), rows
        assert torch.equal(ops.blocked_linear_silu_mul(x[:rows], gate_up, *args),
                           ops.blocked_linear_silu_mul(x[:rows], gate_up)), rows
    module = BlockedLinear(nn.Linear(576, 976, bias=False))
    plain = module(x)
    for name, value in switch.items():
        setattr(module, name, value)         # the module passes its switches to the op
    assert torch.equal(module(x), plain)


def test_pack_linears_falls_back_to_onednn_when_the_blocked_kernel_is_missing(monkeypatch):
    monkeypatch.setattr(fast_linear, "blocked_kernel_available", lambda: False)
    model = nn.Sequential(nn.Linear(24, 32))
    x = torch.randn(3, 24)
    expected = model(x)
    if not fast_linear.onednn_available():
        assert pack_linears(model, "blocked") == 0 and type(model[0]) is nn.Linear
        return
    assert pack_linears(model, "blocked") == 1 and type(model[0]) is PackedLinear
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-4)


@needs_blocked
def test_blocked_linear_module_keeps_the_linears_maths():
    gen = torch.Generator().manual_seed(3)
    lin = nn.Linear(40, 64, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(64, 40, generator=gen))
        lin.bias.copy_(torch.randn(64, generator=gen))
    x = torch.randn(2, 9, 40, generator=gen)       # leading dimensions kept
    got = BlockedLinear(lin)(x)
    assert got.shape == (2, 9, 64)
    torch.testing.assert_close(got, lin(x), rtol=1e-5, atol=1e-4)


@pytest.fixture
def kernel_env(monkeypatch):
    monkeypatch.delenv("BATCHINFER_LINEAR_KERNEL", raising=False)
    return monkeypatch


def test_kernel_choice_follows_the_environment(kernel_env):
    kernel_env.setenv("BATCHINFER_LINEAR_KERNEL", "torch")
    assert linear_kernel() == "torch"
    kernel_env.setenv("BATCHINFER_LINEAR_KERNEL", "ONEDNN")
    assert linear_kernel() == ("onednn" if fast_linear.onednn_available() else "torch")
    kernel_env.setenv("BATCHINFER_LINEAR_KERNEL", "blocked")
    assert linear_kernel() in (("blocked",) if blocked_kernel_available() else ("onednn", "torch"))
    kernel_env.setenv("BATCHINFER_LINEAR_KERNEL", "mkl")
    with pytest.raises(ValueError, match="BATCHINFER_LINEAR_KERNEL='mkl'.*auto, blocked, onednn, torch"):
        linear_kernel()


def test_auto_takes_the_blocked_kernel_where_it_has_its_own_tile(kernel_env):
    """AVX2-only CPUs: the AVX2 tile; AVX-512 CPUs: the AVX-512 tile if built and on, else oneDNN."""
    capability = torch.backends.cpu.get_cpu_capability()
    isa = fast_linear.blocked_kernel_isa()
    onednn = "onednn" if fast_linear.onednn_available() else "torch"
    own_tile = (capability == "AVX2" and isa != "none") or (capability == "AVX512" and isa == "avx512")
    assert linear_kernel() == ("blocked" if own_tile else onednn)
    cases = [("AVX512", "avx512", "blocked"), ("AVX512", "avx2", onednn), ("AVX2", "avx2", "blocked"),
             ("DEFAULT", "avx2", onednn)]
    try:
        for capability, isa, expected in cases:
            if expected == "blocked" and not blocked_kernel_available():
                expected = onednn    # not built here: auto cannot take it
            kernel_env.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
            kernel_env.setattr(fast_linear, "blocked_kernel_isa", lambda i=isa: i)
            fast_linear._resolve.cache_clear()
            assert linear_kernel() == expected, (capability, isa)
    finally:
        fast_linear._resolve.cache_clear()


@needs_blocked
@pytest.mark.skipif(not fast_linear.onednn_available(), reason="oneDNN unavailable")
def test_pack_linears_uses_onednn_where_the_width_does_not_split_in_panels():
    model = nn.Sequential(nn.Linear(24, 32), nn.Linear(32, 13), nn.Linear(13, 48, bias=False))
    x = torch.randn(5, 24)
    expected = model(x)
    weights = [m.weight.detach().clone() for m in model]
    assert pack_linears(model, "blocked") == 3
    assert [type(m) for m in model] == [BlockedLinear, PackedLinear, BlockedLinear]
    assert all(torch.equal(m.dense_weight(), w) for m, w in zip(model, weights))
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-4)
    plain = nn.Sequential(nn.Linear(8, 16))
    assert pack_linears(plain, "torch") == 0 and type(plain[0]) is nn.Linear


@needs_blocked
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 48, 49, 131])
def test_fused_gate_up_silu_mul_is_the_two_ops_bit_for_bit(rows):
    """blocked_linear_silu_mul runs the same FMA chains and the same SiLU code as blocked_linear
    then silu_and_mul: the same bits, at one tile, partial tiles and several row blocks; and
    close to torch's silu(x @ gate^T) * (x @ up^T)."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen)
    w = torch.randn(2 * 96, 576, generator=gen) / 24     # products of order 1, as in a model
    blocked = to_blocked(w).contiguous()
    fused = torch.ops.batchinfer.blocked_linear_silu_mul(x, blocked)
    two_ops = torch.ops.batchinfer.silu_and_mul(torch.ops.batchinfer.blocked_linear(x, blocked))
    assert fused.shape == (rows, 96) and torch.equal(fused, two_ops)
    gate, up = w.chunk(2)
    reference = nn.functional.silu(x @ gate.T) * (x @ up.T)
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)


@needs_blocked
def test_native_ops_fuse_the_gate_up_projection_only_where_it_can(monkeypatch):
    from batchinfer.engine.model.ops import NativeOps, TorchOps

    fused_calls = []
    real = BlockedLinear.silu_mul
    monkeypatch.setattr(BlockedLinear, "silu_mul", lambda self, x: fused_calls.append(1) or real(self, x))
    x = torch.randn(21, 40)                          # [tokens, hidden], as in the model
    for linear, fuses in [(nn.Linear(40, 64, bias=False), True),
                          (nn.Linear(40, 64, bias=True), False),     # a bias: not fused
                          (nn.Linear(40, 48, bias=False), False)]:   # halves of 24: not whole panels
        expected = TorchOps.gate_up_silu_mul(linear, x)
        blocked = BlockedLinear(linear)
        assert blocked.can_fuse_silu_mul == fuses
        for switch, used in [(True, fuses), (False, False)]:
            monkeypatch.setattr(NativeOps, "fuse_silu_mul", switch)
            fused_calls.clear()
            got = NativeOps.gate_up_silu_mul(blocked, x)
            assert bool(fused_calls) == used, (linear, switch)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_blocked
def test_blocked_ops_name_what_they_expect():
    x, w = torch.randn(3, 32), to_blocked(torch.randn(48, 32)).contiguous()
    with pytest.raises(RuntimeError, match="blocked_linear: x \\[M, K\\] and w_blocked"):
        torch.ops.batchinfer.blocked_linear(torch.randn(3, 31), w)
    with pytest.raises(RuntimeError, match="blocked_linear_silu_mul: x must be fp32"):
        torch.ops.batchinfer.blocked_linear_silu_mul(x.double(), w)
    with pytest.raises(RuntimeError, match="blocked_linear: w_blocked must be fp32 or bf16"):
        torch.ops.batchinfer.blocked_linear(x, w.half())
    with pytest.raises(RuntimeError, match="an even number of panels"):
        torch.ops.batchinfer.blocked_linear_silu_mul(x, w)      # 3 panels


@needs_blocked
@pytest.mark.parametrize("switch", [{}, {"prefetch": False}, {"wide": False}])
def test_bf16_panels_are_the_fp32_kernel_over_the_rounded_weights(switch):
    """bf16 panels are widened exactly as they are loaded, so both ops give the fp32 kernel's
    bits over the weights rounded to bf16, in every tile, alone or batched, odd panel counts too."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(131, 576, generator=gen)
    ops = torch.ops.batchinfer
    args = (switch.get("prefetch", True), switch.get("wide", True))
    for out_features in (976, 192, 48):       # 61 panels, 12 (fusable), 3
        rounded = torch.randn(out_features, 576, generator=gen).to(torch.bfloat16)
        w16, w32 = to_blocked(rounded).contiguous(), to_blocked(rounded.float()).contiguous()
        assert w16.dtype == torch.bfloat16
        full = ops.blocked_linear(x, w16, *args)
        assert torch.equal(full, ops.blocked_linear(x, w32, *args)), out_features
        for start, stop in [(0, 1), (5, 6), (3, 97)]:
            assert torch.equal(ops.blocked_linear(x[start:stop], w16, *args), full[start:stop])
        if out_features % 32 == 0:
            assert torch.equal(ops.blocked_linear_silu_mul(x, w16, *args),
                               ops.blocked_linear_silu_mul(x, w32, *args)), out_features


@pytest.mark.parametrize("kernel", ["blocked", "onednn", "torch"])
def test_pack_linears_in_bf16_keeps_fp32_in_and_out(kernel, monkeypatch):
    """weight_dtype bf16: every linear swapped (also where the fp32 kernel would be torch's), its
    weight stored in bf16, fp32 in and out, the maths of the rounded weights within bf16's
    rounding of the input (oneDNN rounds the input and output to bf16 too)."""
    if kernel == "blocked" and not blocked_kernel_available():
        pytest.skip("native CPU kernels unavailable")
    if kernel == "torch":       # neither oneDNN nor the kernels: torch over the rounded weights
        monkeypatch.setattr(fast_linear, "onednn_available", lambda: False)
    if kernel == "onednn" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no vectorized bf16 GEMM on this CPU")
    gen = torch.Generator().manual_seed(9)
    model = nn.Sequential(nn.Linear(64, 96, bias=True), nn.Linear(96, 40, bias=False))
    x = torch.randn(7, 64, generator=gen)
    with torch.no_grad():
        for layer in model:
            layer.weight.normal_(0, 0.1, generator=gen)
        rounded = [nn.functional.linear(x, model[0].weight.bfloat16().float(), model[0].bias)]
        rounded.append(nn.functional.linear(rounded[0], model[1].weight.bfloat16().float()))
        assert pack_linears(model, kernel, weight_dtype=torch.bfloat16) == 2
        got = model(x)
    assert got.dtype == torch.float32
    if kernel == "onednn":
        assert all(isinstance(m, PackedLinear) and m.packed.dtype == torch.bfloat16 for m in model)
    if kernel == "blocked":     # 40 does not split into panels: fp32 over the rounded weights,
        assert isinstance(model[0], BlockedLinear) and model[0].blocked.dtype == torch.bfloat16
        assert isinstance(model[1], RoundedWeightLinear)       # never oneDNN's emulated bf16
    if kernel == "torch":
        assert all(isinstance(m, RoundedWeightLinear) for m in model)
    tolerance = 2e-2 if kernel == "onednn" else 1e-5
    torch.testing.assert_close(got, rounded[1], rtol=tolerance, atol=tolerance)
