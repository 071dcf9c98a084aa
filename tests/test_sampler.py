"""Each sampling transform against a direct per-row reference computation."""
from __future__ import annotations

import math

import torch

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
    tokens, _ = sampler.sample(logits, sampler.prepare(seqs))
    assert tokens.tolist() == [0, 4, 4]


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3))

    def draw(neighbours: int):
        sampler = Sampler(V, (0,), torch.device("cpu"), seed=neighbours)
        seqs = [_seq(f"n{i}", SamplingParams(temperature=1.0)) for i in range(neighbours)]
        seqs.append(_seq("me", params))
        rows = torch.cat([torch.randn(neighbours, V), logits])
        out = []
        for _ in range(20):
            tokens, _ = sampler.sample(rows, sampler.prepare(seqs))
            out.append(tokens[-1].item())
        return out

    assert draw(0) == draw(5) == draw(17)


def test_sampling_follows_the_distribution():
    sampler = Sampler(4, (), torch.device("cpu"), seed=0)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    seqs = [_seq(str(i), SamplingParams(temperature=1.0)) for i in range(4000)]
    tokens, _ = sampler.sample(probs.log().expand(4000, 4).contiguous(), sampler.prepare(seqs))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_logprobs_are_raw_log_softmax():
    logits = torch.randn(2, V)
    info = raw_logprobs(logits, 3)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(info["top_values"], ref.topk(3, -1).values)
    sampler = Sampler(V, (), torch.device("cpu"))
    seqs = [_seq("a", SamplingParams(temperature=0, logprobs=2)), _seq("b", SamplingParams(temperature=0))]
    tokens, info = sampler.sample(logits, sampler.prepare(seqs))
    assert torch.allclose(info["sampled"], ref.gather(1, tokens[:, None]).squeeze(1))
