"""Column-wise (transposed) CPU sampling kernels against the row kernels: bitwise equal results."""
from __future__ import annotations

import random

import pytest
import torch

from batchinfer.engine.kernels import load_native_kernels

if not load_native_kernels():
    pytest.skip("native kernels did not build", allow_module_level=True)

ops = torch.ops.batchinfer


def _strided_columns(rows: torch.Tensor, extra: int, fill: float = 7.0):
    """rows [n, V] -> (logits_t view [V, n] of a [V, n + extra] buffer, the buffer)."""
    n, vocab = rows.shape
    buf = torch.full((vocab, n + extra), fill)
    buf[:, :n] = rows.t()
    view = buf[:, :n]
    assert view.stride() == (n + extra, 1)
    return view, buf


@pytest.mark.parametrize("vocab", [49152, 1003])
@pytest.mark.parametrize("n", [1, 7, 8, 37, 64])
def test_penalties_columns_bitwise_equal_to_rows(vocab, n):
    rng = random.Random(vocab * 100 + n)
    gen = torch.Generator().manual_seed(vocab + n)
    logits = torch.randn(n, vocab, generator=gen) * 4
    logits[:, ::97] = float("-inf")  # masked tokens are penalized too (stay -inf)
    logits[:, 5] = 0.0
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 300))] for _ in range(n)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 200))] for _ in range(n)]
    for i in range(n):  # repeats, and tokens both in the prompt and in the output
        if prompts[i] and outputs[i]:
            outputs[i] += [outputs[i][0]] * 3 + [prompts[i][0], 5]
    rep = [rng.uniform(0.5, 2.0) for _ in range(n)]
    freq = [rng.uniform(-1.0, 1.0) for _ in range(n)]
    pres = [rng.uniform(-1.0, 1.0) for _ in range(n)]
    for i in range(0, n, 3):  # neutral penalties: untouched values
        rep[i], freq[i], pres[i] = 1.0, 0.0, 0.0
    rep, freq, pres = torch.tensor(rep), torch.tensor(freq), torch.tensor(pres)

    def pad(lists):
        width = max((len(x) for x in lists), default=0) or 1
        return torch.tensor([x + [vocab] * (width - len(x)) for x in lists], dtype=torch.long)

    expected = logits.clone()
    ops.apply_penalties_(expected, torch.arange(n), pad(prompts), pad(outputs), rep, freq, pres)

    C = n + 5  # penalty state wider than n; only its first n columns are used
    seen = torch.zeros(vocab, C, dtype=torch.uint8)
    counts = torch.zeros(vocab, C)
    for i in range(n):
        for tok in prompts[i] + outputs[i]:
            seen[tok, i] = 1
        for tok in outputs[i]:
            counts[tok, i] += 1
    seen[:, n:] = 1  # garbage beyond n must be ignored
    counts[:, n:] = 3.0
    present = (counts > 0).float()
    logits_t, buf = _strided_columns(logits, extra=3)
    ops.apply_penalties_columns_(logits_t, seen, counts, present, rep, freq, pres)
    assert torch.equal(logits_t.t(), expected)
    assert torch.equal(buf[:, n:], torch.full((vocab, 3), 7.0))


def _case(rng: random.Random, gen: torch.Generator, vocab: int, n: int):
    scale = rng.choice([1.0, 3.0, 8.0])
    logits = torch.randn(n, vocab, generator=gen) * scale
    if rng.random() < 0.3:  # many ties
        logits = torch.round(logits * 2) / 2
    temperature, top_k, top_p, min_p, uniform = [], [], [], [], []
    for i in range(n):
        greedy = rng.random() < 0.25
        temperature.append(0.0 if greedy else rng.uniform(0.3, 1.5))
        top_k.append(rng.choice([0, 0, 1, 5, 50, vocab, vocab + 10, rng.randrange(2, vocab)]))
        top_p.append(rng.choice([1.0, 0.9, 0.5, 0.01]))
        min_p.append(rng.choice([0.0, 0.05, 0.3] * 5 + [1.5]))  # 1.5: nothing kept -> argmax
        uniform.append(rng.choice([rng.random(), 1e-12, 1 - 1e-12, rng.random()]))
        mask = rng.random()
        if mask < 0.3:  # masked tokens
            logits[i, torch.randperm(vocab, generator=gen)[: vocab // 3]] = float("-inf")
        elif mask < 0.35:  # one token left
            keep = rng.randrange(vocab)
            logits[i, :keep] = float("-inf")
            logits[i, keep + 1:] = float("-inf")
        elif mask < 0.38:  # everything masked: argmax (token 0)
            logits[i] = float("-inf")
    return logits, (torch.tensor(temperature), torch.tensor(top_k, dtype=torch.long),
                    torch.tensor(top_p), torch.tensor(min_p), torch.tensor(uniform, dtype=torch.float64))


@pytest.mark.parametrize("vocab,n,cases", [
    (1003, 1, 40), (1003, 5, 40), (1003, 8, 40), (1003, 9, 40), (1003, 64, 25), (1003, 130, 15),
    (49152, 1, 3), (49152, 5, 2), (49152, 8, 2), (49152, 9, 2), (49152, 64, 1), (49152, 130, 1),
])
def test_sample_columns_same_tokens_as_rows(vocab, n, cases):
    rng = random.Random(vocab * 1000 + n)
    gen = torch.Generator().manual_seed(vocab * 7 + n)
    for _ in range(cases):
        logits, params = _case(rng, gen, vocab, n)
        expected = ops.sample_rows(logits.clone(), *params)
        extra = rng.choice([1, 3, 8])
        logits_t, buf = _strided_columns(logits, extra=extra)
        got = ops.sample_columns(logits_t, *params)
        assert torch.equal(got, expected)
        assert torch.equal(buf[:, n:], torch.full((vocab, extra), 7.0))  # nothing written past n
        assert torch.equal(logits_t.t(), logits)  # (the current kernel does not write logits_t)


def test_sample_columns_all_greedy_is_argmax_and_contiguous_input():
    gen = torch.Generator().manual_seed(3)
    logits = torch.round(torch.randn(11, 1003, generator=gen) * 2)  # ties: the first max wins
    n = logits.shape[0]
    params = (torch.zeros(n), torch.zeros(n, dtype=torch.long), torch.ones(n), torch.zeros(n),
              torch.full((n,), 0.5, dtype=torch.float64))
    got = ops.sample_columns(logits.t().contiguous(), *params)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert torch.equal(got, ops.sample_rows(logits, *params))


def test_sample_columns_rejects_bad_inputs():
    logits_t = torch.randn(100, 4)
    ones = torch.ones(4)
    with pytest.raises(RuntimeError):
        ops.sample_columns(logits_t, torch.ones(3), torch.zeros(3, dtype=torch.long), torch.ones(3),
                           torch.zeros(3), torch.rand(3, dtype=torch.float64))
    with pytest.raises(RuntimeError):
        ops.sample_columns(torch.randn(4, 100).t(), ones, torch.zeros(4, dtype=torch.long), ones,
                           torch.zeros(4), torch.rand(4, dtype=torch.float64))
