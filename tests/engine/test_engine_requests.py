"""Engine behaviour per request: stop conditions, seeds, logprobs, per-request errors."""
from __future__ import annotations

import numpy as np
import pytest

from batchinfer.engine.errors import RequestError
from batchinfer.engine.request import FinishReason, Request, SamplingParams


@pytest.fixture(scope="module")
def tiny(make_engine, tiny_engine_config):
    return make_engine(**tiny_engine_config)


@pytest.fixture(scope="module")
def smol(make_engine):
    return make_engine(model={"max_model_len": 512})


def greedy(**kw):
    return SamplingParams(temperature=0.0, **kw)


def test_max_tokens_and_ignore_eos(tiny):
    out = tiny.generate(["Once upon a time"], greedy(max_tokens=9, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 9 and out.finish_reason is FinishReason.LENGTH


def test_stop_string_cuts_text_like_a_direct_search(tiny):
    full = tiny.generate(["The weather today"], greedy(max_tokens=40, ignore_eos=True))[0]
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), "dummy output too short to pick a stop string"
    cut = tiny.generate(["The weather today"], greedy(max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason is FinishReason.STOP and cut.stop_reason == stop
    assert cut.text == text[: text.find(stop)]
    kept = tiny.generate(["The weather today"], greedy(max_tokens=40, ignore_eos=True, stop=[stop],
                                                       include_stop_str_in_output=True))[0]
    assert kept.text == text[: text.find(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(tiny):
    full = tiny.generate(["Count with me"], greedy(max_tokens=30, ignore_eos=True))[0].output_token_ids
    stop_tok = full[5]
    first = full.index(stop_tok)
    out = tiny.generate(["Count with me"], greedy(max_tokens=30, ignore_eos=True,
                                                  stop_token_ids=[stop_tok]))[0]
    assert out.output_token_ids == full[: first + 1] and out.stop_reason == stop_tok
    later = tiny.generate(["Count with me"], greedy(max_tokens=30, ignore_eos=True,
                                                    stop_token_ids=[stop_tok], min_tokens=first + 2))[0]
    assert len(later.output_token_ids) > first + 1


def test_a_stop_tokens_text_is_left_out_of_the_text_as_vllm_does(tiny):
    """A stop token ends output_token_ids, but its text is in `text` only with
    include_stop_str_in_output (vLLM's detokenizer skips it), as a stop string's is."""
    full = tiny.generate(["Count with me"], greedy(max_tokens=30, ignore_eos=True))[0].output_token_ids
    stop_tok = full[5]
    first = full.index(stop_tok)
    for include in (False, True):
        out = tiny.generate(["Count with me"], greedy(
            max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok],
            include_stop_str_in_output=include))[0]
        assert out.output_token_ids == full[: first + 1]
        kept = full[: first + 1] if include else full[:first]
        assert out.text == tiny.tokenizer.decode(kept)


def test_eos_stops_a_greedy_chat_answer(smol):
    ids = smol.tokenizer.apply_chat_template([{"role": "user", "content": "Say just the word: yes"}])
    out = smol.generate([ids], greedy(max_tokens=64))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.output_token_ids[-1] in smol.tokenizer.eos_token_ids
    assert "yes" in out.text.lower() and "<|im_end|>" not in out.text


def test_seeded_request_is_the_same_alone_and_in_a_batch(smol):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True)
    alone = smol.generate(["Tell me about owls."], params)[0].output_token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 5
    prompts = ["Hi there", "Tell me about owls.", "A long " * 40, "Why?", "List three fruits", "x"]
    batch = smol.generate(prompts, [others[0], params, *others[1:]])
    assert batch[1].output_token_ids == alone


def test_logprobs_are_returned_for_each_token(tiny):
    out = tiny.generate(["abc"], greedy(max_tokens=4, ignore_eos=True, logprobs=3))[0]
    assert len(out.logprobs) == 4
    for entry, token in zip(out.logprobs, out.output_token_ids):
        assert entry["token_id"] == token and entry["logprob"] <= 0
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and tops[0]["token_id"] == token  # greedy: the top token
        assert tops[0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-5)


def test_per_request_errors_leave_the_engine_usable(tiny):
    with pytest.raises(RequestError) as too_long:
        tiny.add_request(Request("long", [5] * tiny.max_model_len, greedy()))
    assert too_long.value.code == "prompt_too_long" and str(tiny.max_model_len) in too_long.value.message
    with pytest.raises(RequestError) as empty:
        tiny.add_request(Request("empty", [], greedy()))
    assert empty.value.code == "empty_prompt"
    with pytest.raises(RequestError):
        tiny.add_request(Request("badtok", [10**9], greedy()))
    assert not tiny.has_unfinished()
    assert tiny.generate(["still fine"], greedy(max_tokens=2))[0].output_token_ids


def test_generate_calls_on_step_after_every_step_with_what_it_finished(tiny):
    calls = []
    tiny.drain_step_events()
    outs = tiny.generate(["a", "b c d e", "f g"],
                         [greedy(max_tokens=n, ignore_eos=True) for n in (2, 5, 9)],
                         on_step=lambda finished: calls.append([o.request_id for o in finished]))
    assert len(calls) == len(tiny.drain_step_events())
    assert sorted(r for step in calls for r in step) == sorted(o.request_id for o in outs)
    # shorter requests finish in earlier steps
    order = [r for step in calls for r in step]
    assert order == [o.request_id for o in outs]


def test_each_step_event_counts_the_context_its_tokens_attend(tiny):
    """num_context_tokens: each sequence's length at the end of the step (its cached tokens
    plus the step's), summed: a prompt's prefill counts its length, each decode step one more
    than the last."""
    prompt = tiny.tokenizer.encode("one two three four five")
    tiny.drain_step_events()
    tiny.generate([prompt], greedy(max_tokens=4, ignore_eos=True))
    events = tiny.drain_step_events()
    assert [e["num_context_tokens"] for e in events] == [len(prompt) + i for i in range(4)]


def test_generate_takes_one_text_as_one_prompt(tiny):
    """A string is one prompt (as vLLM's LLM.generate takes it), not one per character."""
    outs = tiny.generate("Once upon a time", greedy(max_tokens=3, ignore_eos=True))
    assert len(outs) == 1
    assert outs[0].prompt_token_ids == tiny.tokenizer.encode("Once upon a time")


@pytest.mark.parametrize("prompts, sampling, error, match", [
    (["a", "b", "c"], [greedy(max_tokens=2)], ValueError, "3 prompts and 1 sampling params"),
    (["a"], [{"max_tokens": 4}], TypeError, "a SamplingParams, not dict"),
    (["a"], {"max_tokens": 4}, TypeError, "a SamplingParams, not dict"),
    ([None], None, TypeError, "prompt 0: a text or a sequence of token ids, not NoneType"),
    ([np.array([1.5, 2.0])], None, RequestError, "must be integers; got 1.5"),
    ([[1.5, 2]], None, RequestError, "must be integers; got 1.5"),
    ([[True, 2]], None, RequestError, "must be integers; got True"),
    ([1, 2, 3], None, TypeError, "a list of lists"),
    (["fine", ""], None, RequestError, "prompt 1: the prompt has no tokens"),
])
def test_a_bad_generate_call_is_refused_whole_and_leaves_the_engine_usable(
        tiny, prompts, sampling, error, match):
    """Every prompt and its params are checked before any is added: a bad one names itself and
    leaves no request of the call behind (one left would run, unseen, in the next call, or with
    params it cannot read stall the engine)."""
    with pytest.raises(error, match=match):
        tiny.generate(prompts, sampling)
    assert tiny.num_unfinished == 0 and not tiny.has_unfinished()
    assert len(tiny.generate(["again"], (greedy(max_tokens=2),))) == 1


def test_generate_takes_token_ids_in_any_sequence(tiny):
    """A numpy array or a tuple of ids is a token prompt as a list is (numpy ints read as
    ints), as before the checks."""
    ids = tiny.tokenizer.encode("Once upon a time")
    outs = tiny.generate([ids, tuple(ids), np.array(ids)], greedy(max_tokens=3, ignore_eos=True))
    assert outs[0].output_token_ids == outs[1].output_token_ids == outs[2].output_token_ids
    assert outs[2].prompt_token_ids == ids and type(outs[2].prompt_token_ids[0]) is int


def test_add_request_refuses_params_it_cannot_read_before_taking_the_request(tiny):
    with pytest.raises(TypeError, match="sampling must be a SamplingParams, not dict"):
        tiny.add_request(Request("r-dict", [1, 2, 3], {"max_tokens": 4}))
    assert tiny.num_unfinished == 0 and not tiny.has_unfinished()


def test_generate_refuses_while_added_requests_are_unfinished(tiny):
    """generate runs its prompts on an idle engine: with a request added by add_request still
    running it is refused (its result would come out of generate's steps and be lost), and the
    added request's result comes from the caller's own steps."""
    tiny.add_request(Request("manual-1", [1, 2, 3], greedy(max_tokens=2, ignore_eos=True)))
    with pytest.raises(RuntimeError, match="requests added with add_request are unfinished"):
        tiny.generate(["Hello"], greedy(max_tokens=3))
    finished = []
    while tiny.has_unfinished():
        finished += tiny.step()
    assert [out.request_id for out in finished] == ["manual-1"]
    assert len(tiny.generate(["Hello"], greedy(max_tokens=3))) == 1


def test_a_closed_engine_says_so(make_engine, tiny_engine_config):
    """Closing stops the workers: a multi-process engine says it is closed (not a worker's
    death); closing again does nothing. (A one-process engine's close only drops transient
    state, and it goes on.)"""
    engine = make_engine(**tiny_engine_config, parallel={"pp": 2})
    assert len(engine.generate(["Hi"], greedy(max_tokens=2))) == 1
    engine.close()
    engine.close()                                   # twice: nothing more
    for call in (lambda: engine.generate(["Hi"], greedy(max_tokens=2)), engine.step,
                 lambda: engine.add_request(Request("r", [1, 2], greedy(max_tokens=2)))):
        with pytest.raises(RuntimeError, match="the engine is closed"):
            call()


def test_stop_token_ids_are_checked_against_the_models_vocabulary(make_engine,
                                                                  tiny_engine_config):
    """As prompt ids are: the model's embedding rows (here 1,000, under the embedded tokenizer's
    49,152 entries), so an id the model can never produce is refused when the request comes."""
    model = {**tiny_engine_config["model"],
             "hf_overrides": {**tiny_engine_config["model"]["hf_overrides"], "vocab_size": 1000}}
    engine = make_engine(**{**tiny_engine_config, "model": model})
    assert engine.vocab_size == 1000 < engine.tokenizer.vocab_size
    with pytest.raises(RequestError, match=r"stop_token_ids: \[5000\] out of range; this "
                                           r"model's token ids are 0..999") as exc:
        engine.add_request(Request("r", [1, 2], greedy(max_tokens=2, stop_token_ids=[5000])))
    assert exc.value.code == "invalid_sampling"
    engine.add_request(Request("ok", [1, 2], greedy(max_tokens=2, stop_token_ids=[999])))


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, ValueError])
def test_an_interrupted_generate_leaves_an_idle_engine(tiny, interrupt):
    """A Ctrl-C (or an error in on_step) part way through generate loses that call's results,
    so its requests go with it: the next generate runs, instead of being refused for
    'requests added with add_request' the caller never added."""
    def on_step(finished):
        raise interrupt("stop")

    with pytest.raises(interrupt):
        tiny.generate(["Hello there", "abc"], greedy(max_tokens=50, ignore_eos=True),
                      on_step=on_step)
    assert tiny.num_unfinished == 0 and not tiny.has_unfinished()
    outs = tiny.generate(["Hello there"], greedy(max_tokens=3, ignore_eos=True))
    assert len(outs) == 1 and len(outs[0].output_token_ids) == 3
