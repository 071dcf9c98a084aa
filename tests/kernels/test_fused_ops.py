"""The fused CPU kernels against the portable torch ops they replace."""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.attention import AttentionMetadata, NativeCPUAttention, TorchAttention
from batchinfer.engine.kernels import load_native_kernels
from batchinfer.engine.model.ops import NativeOps, TorchOps

pytestmark = pytest.mark.skipif(not load_native_kernels(), reason="native kernels did not build")


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_norms(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen) * 3
    residual = torch.randn(rows, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    torch.testing.assert_close(NativeOps.rms_norm(x, weight, 1e-5), TorchOps.rms_norm(x, weight, 1e-5))
    exp_out, exp_res = TorchOps.add_rms_norm(x, residual, weight, 1e-5)
    got_out, got_res = NativeOps.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    torch.testing.assert_close(got_res, exp_res)
    torch.testing.assert_close(got_out, exp_out)


@pytest.mark.parametrize("rows,cols", [(1, 384), (300, 384), (5, 13)])
def test_add_layer_norm_is_layer_norm_of_the_sum(rows, cols):
    gen = torch.Generator().manual_seed(rows + cols)
    x = torch.randn(rows, 2 * cols, generator=gen)[:, :cols] * 4 + 3   # strided rows, an offset
    residual = torch.randn(rows, cols, generator=gen)
    norm = torch.nn.LayerNorm(cols, eps=1e-12)
    with torch.no_grad():
        norm.weight.normal_(generator=gen)
        norm.bias.normal_(generator=gen)
        want = norm(x + residual)
    got = torch.ops.batchinfer.add_layer_norm(x, residual, norm.weight.detach(), norm.bias.detach(),
                                             norm.eps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("width", [1536, 13])
def test_silu_and_mul(width):
    gate_up = torch.randn(37, 2 * width) * 6
    torch.testing.assert_close(NativeOps.silu_and_mul(gate_up), TorchOps.silu_and_mul(gate_up),
                               rtol=1e-5, atol=1e-6)


def test_rotary_in_place():
    tokens, heads, head_dim = 19, 15, 64
    qkv = torch.randn(tokens, heads * head_dim)
    positions = torch.randint(0, 100, (tokens,))
    angles = torch.outer(torch.arange(100.0), 1.0 / (10000 ** (torch.arange(0, 64, 2) / 64)))
    cos, sin = angles.cos(), angles.sin()
    expected = TorchOps.rotary(qkv.clone(), positions, cos, sin, 12, head_dim)
    got = NativeOps.rotary(qkv.clone(), positions, cos, sin, 12, head_dim)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got[:, 12 * 64:], qkv[:, 12 * 64:])  # v heads untouched


def test_write_kv_matches_index_put():
    caches = [torch.zeros(6, 3, 4, 8) for _ in range(4)]
    meta = AttentionMetadata.build([3, 5], [3, 7], [[4], [1, 5]], 4, torch.device("cpu"))
    k, v = torch.randn(8, 3, 8), torch.randn(8, 3, 8)
    TorchAttention.write_kv(caches[0], caches[1], k, v, meta)
    NativeCPUAttention.write_kv(caches[2], caches[3], k, v, meta)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[0][5, :, 2], k[7])  # seq 1, position 6 -> block 5 offset 2


def test_argmax_rows_matches_torch_including_ties():
    x = torch.randn(33, 49157)
    x[3, 100] = x[3, 7] = 1e4  # a tie: the lower index wins, as in torch.argmax
    x[5] = float("-inf")
    assert torch.equal(torch.ops.batchinfer.argmax_rows(x), x.argmax(dim=-1))
