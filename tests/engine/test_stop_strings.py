"""Which stop string ends a reply when several match, as vLLM's check_stop_strings picks."""
from __future__ import annotations

import pytest

from batchinfer.engine.config import ModelConfig
from batchinfer.engine.output import OutputProcessor
from batchinfer.engine.request import FinishReason, Request, SamplingParams, Sequence
from batchinfer.engine.tokenizer import find_stop, load_tokenizer


def test_the_stop_string_that_ends_first_wins_ties_going_to_the_first_listed():
    """vLLM takes the stop string that completes earliest in the text, ties by list order; the
    one that started earliest used to win ("capital" over "pit" in " capital")."""
    assert find_stop("The capital", 8, ["capital", "pit"]) == ("pit", 6)
    assert find_stop("The capital", 8, ["pit", "capital"]) == ("pit", 6)
    assert find_stop("France is Paris", 6, ["Paris", "is Paris"]) == ("Paris", 10)
    assert find_stop("France is Paris", 6, ["is Paris", "Paris"]) == ("is Paris", 7)
    assert find_stop("France is Paris", 6, ["London"]) is None
    assert find_stop("abc", 0, ["c"]) is None


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig())


@pytest.mark.parametrize("stops,text,stop", [
    (["capital", "pit"], "The ca", "pit"),                 # what vLLM 0.32 writes for each
    (["Paris", "is Paris"], "The capital of France is ", "Paris"),
])
def test_a_reply_stops_at_the_stop_string_vllm_stops_at(tokenizer, stops, text, stop):
    out = OutputProcessor(tokenizer, max_model_len=512)
    seq = Sequence(Request("r", [1, 2, 3], SamplingParams(temperature=0, stop=stops)))
    reply = tokenizer.hf.encode("The capital of France is Paris.", add_special_tokens=False)
    assert any(out.append(seq, token, None) for token in reply)     # stops at the first
    result = out.result(seq)
    assert (result.text, result.stop_reason) == (text, stop)
    assert result.finish_reason is FinishReason.STOP
