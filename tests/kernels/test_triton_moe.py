"""The grouped Triton expert kernels (engine/triton_moe.py, the CUDA path of a mixture of experts)
against StackedExperts' per-expert torch path, and the device-side grouping on its own.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported) on CPU tensors; with one, on the GPU. Decode-sized and prefill-sized batches (one tile
per expert and several), experts that get no pair, a token whose k experts include the same one
twice is impossible in a top-k, so each token's k are distinct; GPT-OSS's biased experts with
the clamped SwiGLU; widths that are not multiples of the tiles; bf16.
"""
from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import DEVICE  # first: the interpreter's setup
from batchinfer.engine.model.fused_experts import (BiasedExperts, StackedExperts,  # noqa: E402
                                                   route, use_triton_experts)
from batchinfer.engine.model.ops import TorchOps  # noqa: E402
from batchinfer.engine.triton_moe import block_m_for, group_by_expert  # noqa: E402


def _experts(kind: str, num_experts: int, hidden: int, rows: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    if kind == "biased":
        experts = BiasedExperts(num_experts, hidden, rows, (1.702, 1.5))
    else:
        experts = StackedExperts(num_experts, hidden, rows)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return experts


def _routing(tokens: int, num_experts: int, top_k: int, seed: int, skip: int = 0):
    """Routing of `tokens` tokens; the last `skip` experts never chosen."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=gen)
    if skip:
        logits[:, num_experts - skip:] = -1e9
    return route(logits, top_k, normalize=True)


@pytest.mark.parametrize("tokens,num_experts,top_k,skip", [
    (1, 8, 2, 0),          # one decode row: two experts of eight
    (5, 16, 2, 10),        # a few rows, 10 of 16 experts without a pair
    (70, 8, 2, 3),         # prefill-sized: several tiles for one expert
    (37, 16, 4, 0),        # top 4, an odd count
])
@pytest.mark.parametrize("kind", ["plain", "biased"])
def test_triton_experts_equal_the_per_expert_path(kind, tokens, num_experts, top_k, skip):
    """The same StackedExperts (or GPT-OSS's BiasedExperts) computed both ways in fp32: the
    kernels' sums equal the per-expert GEMM chains' within fp32 rounding, and both count the
    same pairs per expert."""
    hidden, rows = 48, 40                  # neither a multiple of the 64-wide tiles
    reference = _experts(kind, num_experts, hidden, rows)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    weights, ids = _routing(tokens, num_experts, top_k, seed=2, skip=skip)
    with torch.inference_mode():
        expected = reference(x, weights, ids, TorchOps)
    triton_experts = _experts(kind, num_experts, hidden, rows).to(DEVICE)
    assert use_triton_experts(torch.nn.ModuleList([triton_experts])) == 1
    with torch.inference_mode():
        got = triton_experts(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), TorchOps)
    assert got.dtype == torch.float32 and got.shape == (tokens, hidden)
    torch.testing.assert_close(got.cpu(), expected, rtol=2e-5, atol=2e-5)
    assert triton_experts.load.tolist() == reference.load.tolist()
    if skip:
        assert triton_experts.load.tolist()[num_experts - skip:] == [0] * skip


def test_triton_experts_in_bf16_stay_within_a_rounding_of_fp32():
    """bf16 stacks and inputs (a GPU model's dtype): the kernels accumulate in fp32 and round
    once per projection, so the result is within a few bf16 roundings (of the outputs' scale)
    of the fp32 computation over the same bf16 values."""
    num_experts, hidden, rows, tokens = 8, 64, 64, 20
    fp32 = _experts("plain", num_experts, hidden, rows)
    with torch.no_grad():
        for param in fp32.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(3))
    x = x.to(torch.bfloat16).float()
    weights, ids = _routing(tokens, num_experts, 2, seed=4)
    with torch.inference_mode():
        expected = fp32(x, weights, ids, TorchOps)
    bf16 = _experts("plain", num_experts, hidden, rows).to(DEVICE, torch.bfloat16)
    use_triton_experts(bf16)
    with torch.inference_mode():
        got = bf16(x.to(DEVICE, torch.bfloat16), weights.to(DEVICE), ids.to(DEVICE), TorchOps)
    assert got.dtype == torch.bfloat16
    # bf16 rounds the projections' outputs (the activation's input and the result): 2^-8 of the
    # values' scale, a few times over
    error = (got.float().cpu() - expected).abs().max()
    assert error <= 2 ** -6 * expected.abs().max()


def test_grouping_pads_each_expert_to_whole_tiles_without_a_host_read():
    """Each expert's pairs in one run of whole tiles, in token order, padding marked with the
    pair count; each tile names its expert, -1 past the last run; the capacity bounds the runs."""
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [1, 3]])     # expert 2 gets nothing
    pairs, tile_expert, counts = group_by_expert(ids, num_experts=4, block_m=2)
    pad = ids.numel()
    assert counts.tolist() == [2, 2, 0, 4]
    # runs: expert 0 at [0, 2), 1 at [2, 4), 3 at [4, 8); capacity 8 + 3 x 1 = 11 -> 12
    assert pairs.tolist() == [1, 4, 3, 6, 0, 2, 5, 7, pad, pad, pad, pad]
    assert tile_expert.tolist() == [0, 1, 3, 3, -1, -1]
    flat = ids.reshape(-1)
    for tile, expert in enumerate(tile_expert.tolist()):
        for pair in pairs[2 * tile:2 * tile + 2].tolist():
            if pair < pad:
                assert flat[pair] == expert


def test_tile_rows_follow_the_pairs_each_expert_gets():
    assert block_m_for(8, 128) == 16             # a decode step of 1 sequence, top 8 of 128
    assert block_m_for(256 * 8, 128) == 16       # 256 decoding sequences: 16 pairs an expert
    assert block_m_for(512 * 8, 128) == 32
    assert block_m_for(16384 * 8, 128) == 64     # a prefill step


def test_packed_experts_refuse_the_triton_kernels():
    experts = _experts("plain", 4, 32, 16)
    experts.panels = (torch.empty(0), torch.empty(0))
    with pytest.raises(ValueError, match="dense stacks"):
        use_triton_experts(experts)


# --- whole tiny models: each mixture-of-experts family with its experts through the kernels ----

from tests.engine import test_model_families as model_families  # noqa: E402

family_models = model_families.family_models


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss"])
def test_each_moe_family_through_the_triton_experts_gives_transformers_logits(family_models,
                                                                              family):
    """The tiny model of each mixture-of-experts family (Qwen2-MoE's shared expert, Qwen3-MoE's
    dense first layer, Mixtral, GPT-OSS's biased experts and clamped SwiGLU) with every sparse
    layer's experts in the Triton kernels, fp32: each prompt position's logits within 1e-4 of
    transformers' and its greedy tokens."""
    from batchinfer.engine.model.loader import build_model, load_arch
    from batchinfer.engine.torch_attention import TorchAttention
    from tests.tiny_families import check_against_transformers

    path, expected, hf = family_models(family)
    model = build_model(path, load_arch(path), torch.float32, DEVICE, 256, pack=False)
    assert use_triton_experts(model) >= 1
    check_against_transformers(model, TorchAttention(), hf, expected, DEVICE)


def test_no_tokens_give_an_empty_sum_and_no_load():
    from batchinfer.engine.triton_moe import fused_experts

    experts = _experts("plain", 4, 32, 16)
    x = torch.zeros(0, 32, device=DEVICE)
    ids = torch.zeros(0, 2, dtype=torch.long, device=DEVICE)
    out, counts = fused_experts(x, torch.zeros(0, 2, device=DEVICE), ids,
                                experts.gate_up.to(DEVICE), experts.down.to(DEVICE),
                                TorchOps.silu_and_mul)
    assert out.shape == (0, 32) and counts.tolist() == [0, 0, 0, 0]
