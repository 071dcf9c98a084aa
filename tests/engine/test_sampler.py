"""Each sampling transform against a direct per-row reference computation."""
from __future__ import annotations

import math

import pytest
import torch

from batchinfer.engine.kernels import load_native_kernels

from batchinfer.engine.request import Request, SamplingParams, Sequence
from batchinfer.engine.sampler import (Sampler, apply_min_p, apply_penalties, apply_top_k_top_p,
                                       raw_logprobs)

V = 50


def test_penalties_match_vllm_definition():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=gen) * 4
    prompts = [[1, 2, 3], [4], [5, 5, 6]]
    outputs = [[2, 2, 9], [], [7, 8, 7, 7]]
    rep, freq, pres = [1.3, 1.0, 0.7], [0.5, 0.2, -0.3], [0.25, 1.0, 0.0]
    pad = lambda rows: torch.tensor([r + [V] * (4 - len(r)) for r in rows])
    got = apply_penalties(logits.clone(), pad(prompts), pad(outputs), torch.tensor(rep),
                          torch.tensor(freq), torch.tensor(pres))
    for row in range(3):
        for tok in range(V):
            x = logits[row, tok].item()
            if tok in prompts[row] or tok in outputs[row]:
                x = x / rep[row] if x > 0 else x * rep[row]
            count = outputs[row].count(tok)
            x -= freq[row] * count + pres[row] * (count > 0)
            assert math.isclose(got[row, tok].item(), x, rel_tol=1e-5, abs_tol=1e-5)


def test_native_penalties_match_the_torch_ones():
    if not load_native_kernels():
        pytest.skip("native kernels did not build")
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, V, generator=gen) * 4
    rows = torch.tensor([0, 2, 3])
    prompts = torch.tensor([[1, 2, 3, V], [4, V, V, V], [5, 5, 6, 49]])
    outputs = torch.tensor([[2, 2, 9, V, V], [V, V, V, V, V], [7, 8, 7, 7, 1]])
    rep, freq, pres = torch.tensor([1.3, 1.0, 0.7]), torch.tensor([0.5, 0.2, -0.3]), torch.tensor([0.25, 1.0, 0.0])
    expected = logits.clone()
    expected[rows] = apply_penalties(logits[rows], prompts, outputs, rep, freq, pres)
    got = logits.clone()
    torch.ops.batchinfer.apply_penalties_(got, rows, prompts, outputs, rep, freq, pres)
    torch.testing.assert_close(got, expected)


def _ref_filter(row: torch.Tensor, k: int, p: float, min_p: float) -> set[int]:
    """The tokens a direct computation keeps: min_p, then top-k, then the top-p nucleus."""
    probs = torch.softmax(row, -1)
    keep = [t for t in range(V) if probs[t] >= min_p * probs.max()]
    keep.sort(key=lambda t: -row[t].item())
    if k > 0:
        keep = keep[:k]
    sub = torch.softmax(row[keep], -1)
    nucleus, total = [], 0.0
    for t, pt in zip(keep, sub.tolist()):
        nucleus.append(t)
        total += pt
        if total >= p:
            break
    return set(nucleus)


def test_top_k_top_p_min_p_keep_the_reference_sets():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=gen) * 2
    ks, ps, mps = [5, V, 1, 20], [1.0, 0.6, 0.9, 0.3], [0.0, 0.1, 0.0, 0.05]
    filtered = apply_top_k_top_p(apply_min_p(logits, torch.tensor(mps)), torch.tensor(ks),
                                 torch.tensor(ps))
    for row in range(4):
        kept = set(torch.nonzero(torch.isfinite(filtered[row])).flatten().tolist())
        assert kept == _ref_filter(logits[row], ks[row], ps[row], mps[row])


def _seq(rid, params, prompt=(1, 2, 3), out=()):
    s = Sequence(Request(rid, list(prompt), params))
    s.output_token_ids = list(out)
    return s


def test_greedy_rows_take_argmax_after_penalties_and_min_tokens_masks_eos():
    sampler = Sampler(V, eos_token_ids=(0,), device=torch.device("cpu"))
    logits = torch.zeros(3, V)
    logits[:, 0] = 10.0   # EOS is the argmax
    logits[:, 4] = 9.0
    seqs = [_seq("a", SamplingParams(temperature=0)),
            _seq("b", SamplingParams(temperature=0, min_tokens=2)),
            _seq("c", SamplingParams(temperature=0, repetition_penalty=2.0), prompt=(0,))]
    batch = sampler.prepare(seqs)
    # an all-greedy batch builds no per-row sampling tensors (on CUDA: no copies for them)
    assert batch.all_greedy and batch.temperature is None and batch.uniform is None
    assert [t.tolist() for t in batch.min_tokens_index] == [[1], [0]]
    tokens, _ = sampler.sample(logits, batch)
    assert tokens.tolist() == [0, 4, 4]


def test_the_largest_top_k_is_known_on_the_host():
    sampler = Sampler(V, eos_token_ids=(0,), device=torch.device("cpu"))
    seqs = [_seq("a", SamplingParams(temperature=1.0, top_k=3)),
            _seq("b", SamplingParams(temperature=1.0, top_k=7))]
    assert sampler.prepare(seqs).top_k_max == 7
    seqs.append(_seq("c", SamplingParams(temperature=1.0)))      # top_k off: the whole vocabulary
    assert sampler.prepare(seqs).top_k_max == V


@pytest.mark.parametrize("native", [False, True])
def test_seeded_rows_do_not_depend_on_batch_neighbours(native):
    if native and not load_native_kernels():
        pytest.skip("native kernels did not build")
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3))

    def draw(neighbours: int):
        sampler = Sampler(V, (0,), torch.device("cpu"), seed=neighbours, native_kernels=native)
        seqs = [_seq(f"n{i}", SamplingParams(temperature=1.0)) for i in range(neighbours)]
        seqs.append(_seq("me", params))
        rows = torch.cat([torch.randn(neighbours, V), logits])
        out = []
        for _ in range(20):
            tokens, _ = sampler.sample(rows, sampler.prepare(seqs))
            out.append(tokens[-1].item())
            for s in seqs:
                s.output_token_ids.append(out[-1])
        return out

    assert draw(0) == draw(5) == draw(17)
    assert len(set(draw(0))) > 1


@pytest.mark.parametrize("native", [False, True])
def test_sampling_follows_the_filtered_distribution(native):
    if native and not load_native_kernels():
        pytest.skip("native kernels did not build")
    sampler = Sampler(5, (), torch.device("cpu"), seed=0, native_kernels=native)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.35, 0.05])
    n = 6000
    seqs = [_seq(str(i), SamplingParams(temperature=1.0, top_k=4, top_p=0.8)) for i in range(n)]
    tokens, _ = sampler.sample(probs.log().expand(n, 5).contiguous(), sampler.prepare(seqs))
    freq = torch.bincount(tokens, minlength=5).float() / n
    # top_k=4 drops token 4; top_p=0.8 of the rest (0.95): 0.35 and 0.3 come before the mass
    # reaches 0.8*0.95, 0.2 after it (0.65 < 0.76) is kept too, 0.1 is dropped.
    expected = torch.tensor([0.0, 0.2, 0.3, 0.35, 0.0]) / 0.85
    assert torch.allclose(freq, expected, atol=0.03)


def test_native_kernel_matches_the_torch_path():
    if not load_native_kernels():
        pytest.skip("native kernels did not build")
    gen = torch.Generator().manual_seed(5)
    rows = 64
    logits = torch.randn(rows, 4000, generator=gen) * 3
    logits[3, 100:] = float("-inf")
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.3][i % 4], top_k=[0, 20, 0, 5][i % 4],
                             top_p=[1.0, 0.9, 0.5, 1.0][(i // 4) % 4], min_p=[0.0, 0.05][(i // 16) % 2],
                             seed=i) for i in range(rows)]
    seqs = [_seq(str(i), p) for i, p in enumerate(params)]
    torch_tokens, _ = Sampler(4000, (), torch.device("cpu")).sample(
        logits, Sampler(4000, (), torch.device("cpu")).prepare(seqs))
    native = Sampler(4000, (), torch.device("cpu"), native_kernels=True)
    native_tokens, _ = native.sample(logits, native.prepare(seqs))
    assert torch.equal(native_tokens, torch_tokens)


def test_logprobs_are_raw_log_softmax():
    logits = torch.randn(2, V)
    info = raw_logprobs(logits, 3)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(info["top_values"], ref.topk(3, -1).values)
    sampler = Sampler(V, (), torch.device("cpu"))
    seqs = [_seq("a", SamplingParams(temperature=0, logprobs=2)), _seq("b", SamplingParams(temperature=0))]
    tokens, info = sampler.sample(logits, sampler.prepare(seqs))
    assert torch.allclose(info["sampled"], ref.gather(1, tokens[:, None]).squeeze(1))


def _padded_from_lists(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)


def test_kept_token_history_equals_padding_from_scratch_as_sequences_come_and_go():
    import random

    from batchinfer.engine.token_history import TokenHistory

    rng = random.Random(0)
    history, live, made = TokenHistory(), [], 0
    for step in range(300):
        if not live or rng.random() < 0.2:                    # a sequence joins
            seq = Sequence(Request(f"r{made}", [rng.randrange(50) for _ in range(rng.randrange(1, 40))],
                                   SamplingParams(presence_penalty=0.5)))
            seq.output_token_ids.extend(rng.randrange(50) for _ in range(rng.randrange(0, 3)))
            live.append(seq)
            made += 1
        if len(live) > 1 and rng.random() < 0.15:             # one finishes
            history.release(live.pop(rng.randrange(len(live))).request_id)
        if rng.random() < 0.05:                               # one restarts: other outputs, same id
            seq = rng.choice(live)
            seq.output_token_ids[:] = [50 + t for t in range(rng.randrange(0, 5))]
        if rng.random() < 0.05:                               # an id reused, never released
            k = rng.randrange(len(live))
            live[k] = Sequence(Request(live[k].request_id, [60 + t for t in range(rng.randrange(1, 9))],
                                       SamplingParams(presence_penalty=0.5)))
        batch = rng.sample(live, rng.randrange(1, len(live) + 1))
        prompt, output = history.padded(batch, 99, torch.device("cpu"))
        assert torch.equal(prompt, _padded_from_lists([s.request.prompt_token_ids for s in batch], 99))
        assert torch.equal(output, _padded_from_lists([s.output_token_ids for s in batch], 99))
        for seq in live:
            seq.output_token_ids.append(rng.randrange(50))
    assert len(history) <= len(live)
