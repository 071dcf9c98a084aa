"""allowed_token_ids and logit_bias (vLLM's built-in logits processors) in the engine's sampler:
only the allowed ids are ever sampled, a bias moves a token's logit by its amount before the
penalties and the sampling filters, logprobs stay the model's raw ones, and rows without either
sample as before. The SiPipe column sampler gives the same tokens (tests/strategies/test_sipipe.py
runs both samplers over the same rows)."""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.kernels import load_native_kernels
from batchinfer.engine.request import Request, SamplingParams, Sequence
from batchinfer.engine.sampler import Sampler

VOCAB = 50


def _rows(*params: SamplingParams) -> list[Sequence]:
    return [Sequence(Request(f"r{i}", [1, 2, 3], p)) for i, p in enumerate(params)]


@pytest.mark.parametrize("native", [False, True])
def test_allowed_ids_and_a_bias_steer_the_sampled_tokens(native):
    if native and not load_native_kernels():
        pytest.skip("native kernels did not build")
    sampler = Sampler(VOCAB, (0,), torch.device("cpu"), native_kernels=native)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[:, 20] = 10.0                              # every row's argmax
    rows = _rows(SamplingParams(temperature=0, allowed_token_ids=[4, 8, 15]),
                 SamplingParams(temperature=0, logit_bias={33: 30.0}, logprobs=1),
                 SamplingParams(temperature=0, logit_bias={20: -100.0}),
                 SamplingParams(temperature=0))
    tokens, info = sampler.sample(logits.clone(), sampler.prepare(rows))
    assert tokens[0].item() == max((4, 8, 15), key=lambda t: logits[0, t].item())
    assert tokens[1].item() == 33
    assert tokens[2].item() == int(torch.cat([logits[2, :20], torch.tensor([-1e9]),
                                              logits[2, 21:]]).argmax())
    assert tokens[3].item() == 20                     # no constraint: as before
    raw = torch.log_softmax(logits[1], -1)[33].item()  # the model's, not the biased one
    assert float(info["sampled"][1]) == pytest.approx(raw, abs=1e-5)


def test_sampled_rows_never_leave_the_allowed_ids():
    sampler = Sampler(VOCAB, (0,), torch.device("cpu"))
    allowed = [2, 5, 7]
    rows = _rows(*(SamplingParams(temperature=1.5, seed=s, allowed_token_ids=allowed)
                   for s in range(40)))
    logits = torch.randn(40, VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    tokens, _ = sampler.sample(logits, sampler.prepare(rows))
    assert set(tokens.tolist()) <= set(allowed) and len(set(tokens.tolist())) > 1


def test_a_bias_comes_before_the_penalties():
    """vLLM adds the bias, then penalises: a repetition penalty divides the biased logit."""
    sampler = Sampler(VOCAB, (0,), torch.device("cpu"))
    logits = torch.zeros(1, VOCAB)
    logits[0, 10] = 4.0
    logits[0, 3] = 5.0                 # 3 is in the prompt: penalised
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={3: 2.0})
    tokens, _ = sampler.sample(logits, sampler.prepare(_rows(params)))
    assert tokens.item() == 10         # (5 + 2) / 2 = 3.5 < 4; penalise first would give 4.5


def test_ids_past_the_vocabulary_are_named():
    params = SamplingParams(logit_bias={"7": 1.0, "900": 2.0})
    assert params.token_ids_problem(VOCAB) == ("logit_bias: [900] out of range; this model's "
                                               "token ids are 0..49")
    assert SamplingParams(allowed_token_ids=[1, 60]).token_ids_problem(VOCAB).startswith(
        "allowed_token_ids: [60]")
    with pytest.raises(ValueError, match="not true or false"):
        SamplingParams(logit_bias={"3": True})
    with pytest.raises(ValueError, match="must not be empty"):
        SamplingParams(allowed_token_ids=[])
