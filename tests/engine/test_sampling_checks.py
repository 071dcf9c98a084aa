"""SamplingParams refuses values that would run as something nobody meant."""
from __future__ import annotations

import math

import pytest
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
    (stop_token_ids_problem) when its size is known."""
    with pytest.raises(ValidationError) as exc:
        SamplingParams(stop_token_ids=[3, -1])
    (err,) = exc.value.errors()
    assert err["loc"] == ("stop_token_ids", 1) and "greater than or equal to 0" in err["msg"]
    params = SamplingParams(stop_token_ids=[0, 49151, 999999999])
    assert params.stop_token_ids_problem(49152) == ("[999999999] out of range; this model's "
                                                    "token ids are 0..49151")
    assert SamplingParams(stop_token_ids=[49151]).stop_token_ids_problem(49152) is None
    assert SamplingParams().stop_token_ids_problem(10) is None
