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


# --- bad_words ---------------------------------------------------------------------------------
def test_bad_words_tokenize_as_vllms_with_and_without_a_leading_space(default_model_dir):
    """Each word's leading whitespace stripped, then as written and with one leading space, the
    spaced form kept only where it starts with another token and has as many (vLLM's
    update_from_tokenizer); a word with no tokens, or ids past the model's vocabulary, refused."""
    from batchinfer.engine.config import ModelConfig
    from batchinfer.engine.errors import RequestError
    from batchinfer.engine.token_constraints import bad_words_token_ids
    from batchinfer.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(ModelConfig())
    enc = lambda text: tok.hf.encode(text, add_special_tokens=False)    # noqa: E731
    assert enc("Paris") != enc(" Paris") and len(enc(" Paris")) == 1
    assert bad_words_token_ids(tok, ["  Paris"], 49152) == [enc("Paris"), enc(" Paris")]
    two = enc("capital of")
    assert len(two) == 2 and bad_words_token_ids(tok, ["capital of"], 49152) == \
        [two, enc(" capital of")]
    assert len(enc("Berlin")) != len(enc(" Berlin"))                  # spaced form dropped
    assert bad_words_token_ids(tok, ["Berlin"], 49152) == [enc("Berlin")]
    with pytest.raises(RequestError, match=r"bad_words: ' ' gives no token"):
        bad_words_token_ids(tok, [" "], 49152)
    with pytest.raises(RequestError, match=r"past this model's vocabulary \(0..99\)"):
        bad_words_token_ids(tok, ["Paris"], 100)
    with pytest.raises(RequestError, match="more than vLLM's 128"):
        bad_words_token_ids(tok, [f"word{i}" for i in range(70)], 49152)


def test_a_bad_word_bans_its_last_token_only_after_its_other_tokens():
    """vLLM's apply_bad_words: a one-token word always; a longer one where the reply so far
    ends with its other tokens (the prompt does not count: a reply shorter than them bans
    nothing)."""
    from batchinfer.engine.token_constraints import bad_word_bans

    words = [[4], [7, 9], [1, 2, 3]]
    assert bad_word_bans([(0, words, [])]) == [(0, 4)]
    assert bad_word_bans([(0, words, [5, 7])]) == [(0, 4), (0, 9)]
    assert bad_word_bans([(0, words, [7, 5])]) == [(0, 4)]
    assert bad_word_bans([(2, words, [0, 1, 2])]) == [(2, 4), (2, 3)]
    assert bad_word_bans([(1, words, [2])]) == [(1, 4)]


def test_the_sampler_skips_a_bad_words_last_token_and_logprobs_stay_raw():
    sampler = Sampler(VOCAB, (0,), torch.device("cpu"))
    logits = torch.zeros(3, VOCAB)
    logits[:, 9] = 10.0                      # every row's argmax
    logits[:, 12] = 8.0                      # then this
    rows = _rows(SamplingParams(temperature=0, logprobs=0, bad_words=["x"]),
                 SamplingParams(temperature=0, bad_words=["x"]), SamplingParams(temperature=0))
    for seq in rows[:2]:
        seq.request.bad_words_token_ids = [[7, 9]]
    rows[0].output_token_ids = [3, 7]        # ends with the word's first token: 9 banned
    rows[1].output_token_ids = [7, 3]
    tokens, info = sampler.sample(logits.clone(), sampler.prepare(rows))
    assert tokens.tolist() == [12, 9, 9]
    assert float(info["sampled"][0]) == pytest.approx(torch.log_softmax(logits[0], -1)[12].item())


def test_an_engine_reply_never_holds_a_bad_word(make_engine):
    """SmolLM2 greedy: " Paris" after "The capital of France is" goes; with "capital of" also
    banned, " of" never follows " capital" (the reply vLLM 0.32 gives for the same, checked by
    hand: " the capital city of France.")."""
    engine = make_engine(model={"max_model_len": 256})
    prompt = "The capital of France is"
    free, banned = engine.generate([prompt, prompt], [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=12, bad_words=["Paris", "capital of"])])
    tok = engine.tokenizer.hf
    paris = tok.encode(" Paris", add_special_tokens=False)[0]
    capital, of = tok.encode(" capital of", add_special_tokens=False)
    assert free.output_token_ids[0] == paris
    ids = banned.output_token_ids
    assert paris not in ids and capital in ids
    assert all(not (a == capital and b == of) for a, b in zip(ids, ids[1:]))
    assert banned.text.startswith(" the capital city of France.")
