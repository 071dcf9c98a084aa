"""SamplingParams refuses values that would run as something nobody meant."""
from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from batchinfer.engine.request import SamplingParams


@pytest.mark.parametrize("key", ["temperature", "top_p", "min_p", "presence_penalty",
                                 "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_floats_are_refused_naming_the_key(key, value):
    """`temperature: Infinity` used to be accepted."""
    with pytest.raises(ValidationError) as exc:
        SamplingParams(**{key: value})
    (err,) = exc.value.errors()
    assert err["loc"] == (key,) and err["msg"] == "Input should be a finite number"


def test_stop_token_ids_are_token_ids():
    """Negative ids used to be accepted; ids past the vocabulary are checked against the model
    (token_ids_problem) when its size is known."""
    with pytest.raises(ValidationError) as exc:
        SamplingParams(stop_token_ids=[3, -1])
    (err,) = exc.value.errors()
    assert err["loc"] == ("stop_token_ids", 1) and "greater than or equal to 0" in err["msg"]
    params = SamplingParams(stop_token_ids=[0, 49151, 999999999])
    assert params.token_ids_problem(49152) == ("stop_token_ids: [999999999] out of range; this model's "
                                                    "token ids are 0..49151")
    assert SamplingParams(stop_token_ids=[49151]).token_ids_problem(49152) is None
    assert SamplingParams().token_ids_problem(10) is None


def test_repetition_penalty_has_no_upper_bound_as_in_vllm():
    """vLLM takes any repetition_penalty > 0; 2.5 used to be an invalid_sampling record."""
    assert SamplingParams(repetition_penalty=2.5).repetition_penalty == 2.5
    assert SamplingParams(repetition_penalty=10).repetition_penalty == 10
    for bad in (0.0, -1.0):
        with pytest.raises(ValidationError) as exc:
            SamplingParams(repetition_penalty=bad)
        assert exc.value.errors()[0]["loc"] == ("repetition_penalty",)


def test_seed_minus_one_means_unseeded_as_in_vllm():
    """vLLM reads seed -1 as no seed; it used to be the fixed seed -1 here: every such request
    drew the same numbers (identical replies to one prompt) and was deduplicated as seeded."""
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=3).with_overrides(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2 and SamplingParams(seed=0).seed == 0


def test_seed_minus_one_requests_draw_their_own_numbers():
    from batchinfer.engine.request import Request, Sequence
    from batchinfer.engine.sampler import Sampler
    from batchinfer.runner.read_ahead import dedup_key

    params = SamplingParams(temperature=1.0, seed=-1)
    seqs = [Sequence(Request(rid, [1, 2, 3], params)) for rid in ("a", "b")]
    uniform = Sampler(10, (0,), torch.device("cpu"), seed=0).prepare(seqs).uniform
    assert uniform[0] != uniform[1]
    assert dedup_key(seqs[0].request) is None


def test_vllm_keys_batchinfer_does_not_implement_are_named_not_ignored():
    """A recipe's `sampling:` or the Python API: vLLM's default runs, another value is refused
    by name (it was an unknown key; a real value would otherwise be silently undone)."""
    assert SamplingParams(logit_bias={}, spaces_between_special_tokens=True) == SamplingParams()
    with pytest.raises(ValidationError) as exc:
        SamplingParams(temperature=0, detokenize=False)
    assert "detokenize is a vLLM sampling parameter batchinfer does not implement" in str(exc.value)
    with pytest.raises(ValidationError, match="must be 1..16384"):
        SamplingParams(n=0)
