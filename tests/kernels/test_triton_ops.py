"""The Triton element-wise kernels (triton_ops.py, the CUDA path) against TorchOps.

Without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) on CPU tensors. fp32 within float rounding; bf16 within one bf16 rounding.
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import DEVICE  # first: the interpreter's setup
from batchinfer.engine.model.ops import TorchOps  # noqa: E402
from batchinfer.engine.triton_ops import TritonOps  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _rand(*shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_the_fused_residual_add(dtype):
    x, res, w = _rand(7, 96, dtype=dtype), _rand(7, 96, dtype=dtype, seed=1), _rand(96, dtype=dtype, seed=2)
    torch.testing.assert_close(TritonOps.rms_norm(x, w, 1e-6), TorchOps.rms_norm(x, w, 1e-6), **TOL[dtype])
    want_norm, want_sum = TorchOps.add_rms_norm(x, res, w, 1e-6)
    got_norm, got_sum = TritonOps.add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    # one rounding, as torch's add (the interpreter's bf16 casts may land one ulp off)
    torch.testing.assert_close(got_sum, want_sum,
                               **(TOL[dtype] if dtype == torch.bfloat16 else dict(rtol=0, atol=0)))
    torch.testing.assert_close(got_norm, want_norm, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    gate_up = _rand(5, 2 * 1500, dtype=dtype)                       # two column blocks, one ragged
    torch.testing.assert_close(TritonOps.silu_and_mul(gate_up), TorchOps.silu_and_mul(gate_up),
                               **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rotates_the_query_and_key_heads_only(dtype):
    heads, kv_heads, head_dim, tokens = 6, 2, 32, 9
    qkv = _rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    angles = torch.outer(torch.arange(64, dtype=torch.float32), torch.rand(head_dim // 2) + 0.1)
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    positions = torch.tensor([0, 5, 63, 2, 2, 7, 11, 40, 1], device=DEVICE)
    want = TorchOps.rotary(qkv.clone(), positions, cos, sin, heads + kv_heads, head_dim)
    got = TritonOps.rotary(qkv.clone(), positions, cos, sin, heads + kv_heads, head_dim)
    torch.testing.assert_close(got, want, **TOL[dtype])
    v = (heads + kv_heads) * head_dim
    assert torch.equal(got[:, v:], qkv[:, v:])
