"""structured_outputs (vLLM's, on xgrammar): every reply the real SmolLM2 samples under a JSON
schema parses and validates, a regex reply matches in full, a choice reply is one of the choices;
constrained rows are the same alone and batched, and unconstrained rows beside them are untouched;
the grammar's end is the request's (EOS, finish_reason stop); logprobs are the masked
distribution's, as vLLM's. The parameters' checks (tokenizer-free, as vLLM's front end) are in
test_structured_params.py."""
from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")

from batchinfer.engine.errors import RequestError  # noqa: E402
from batchinfer.engine.request import FinishReason, Request, SamplingParams, Sequence  # noqa: E402
from batchinfer.engine.sampler import Sampler  # noqa: E402

# bounded (strings, items), so a sampled reply ends within max_tokens
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                  "maxItems": 2}}}
QUESTIONS = ["Describe a made-up person as JSON.", "Who was Ada Lovelace?",
             "Invent a pirate and give their age.", "Tell me about your best friend."]


def person_problem(value) -> str | None:
    """PERSON checked by hand (jsonschema is not a dependency); None: valid."""
    if not isinstance(value, dict):
        return "not an object"
    if set(value) - {"name", "age", "tags"} or not {"name", "age"} <= set(value):
        return f"keys {sorted(value)}"
    if not isinstance(value["name"], str) or len(value["name"]) > 20:
        return "name"
    age = value["age"]
    if isinstance(age, bool) or not isinstance(age, int) or not 0 <= age <= 150:
        return "age"
    tags = value.get("tags", [])
    if not isinstance(tags, list) or len(tags) > 2 or not all(
            isinstance(t, str) and len(t) <= 12 for t in tags):
        return "tags"
    return None


@pytest.fixture(scope="module")
def smol(make_engine):
    return make_engine(model={"max_model_len": 512})


def chat(engine, question: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])


def sampled(engine, structured: dict, seeds=range(6), **kw) -> list:
    prompts = [chat(engine, QUESTIONS[s % len(QUESTIONS)]) for s in seeds]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=kw.pop("max_tokens", 120),
                             structured_outputs=structured, **kw) for s in seeds]
    return engine.generate(prompts, params)


def test_sampled_json_replies_parse_and_follow_the_schema(smol):
    # no whitespace but the separators' (else a sampled reply may pad between tokens at length)
    outs = sampled(smol, {"json": PERSON, "disable_any_whitespace": True})
    for out in outs:
        assert out.finish_reason is FinishReason.STOP, out.text
        assert out.output_token_ids[-1] in smol.tokenizer.eos_token_ids
        assert person_problem(json.loads(out.text)) is None, out.text
    assert len({out.text for out in outs}) > 1        # temperature 1: not one reply


def test_the_schema_given_as_text_is_the_same_constraint(smol):
    as_dict = sampled(smol, {"json": PERSON}, seeds=[3], max_tokens=30)[0]
    as_text = sampled(smol, {"json": json.dumps(PERSON)}, seeds=[3], max_tokens=30)[0]
    assert as_text.output_token_ids == as_dict.output_token_ids


def test_sampled_regex_replies_match_in_full(smol):
    pattern = r"(Mr|Ms)\. [A-Z][a-z]{1,12}, aged [1-9][0-9]?"
    for out in sampled(smol, {"regex": pattern}):
        assert out.finish_reason is FinishReason.STOP
        assert re.fullmatch(pattern, out.text), out.text


def test_sampled_choice_replies_are_one_of_the_choices(smol):
    choices = ["yes", "no", "it depends", "Paris, France"]
    texts = [out.text for out in sampled(smol, {"choice": choices}, seeds=range(10))]
    assert set(texts) <= set(choices) and len(set(texts)) > 1, texts


def test_an_ebnf_grammar_and_json_object(smol):
    grammar = 'root ::= "The colour is " ("red" | "green" | "blue") "."'
    for out in sampled(smol, {"grammar": grammar}, seeds=range(3)):
        assert re.fullmatch(r"The colour is (red|green|blue)\.", out.text), out.text
    for out in sampled(smol, {"json_object": True}, seeds=range(3), max_tokens=200):
        if out.finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(out.text), dict), out.text


def test_greedy_constrained_rows_are_the_same_alone_and_batched(smol):
    prompts = [chat(smol, q) for q in QUESTIONS]
    params = [SamplingParams(temperature=0, max_tokens=80, structured_outputs={"json": PERSON}),
              SamplingParams(temperature=0, max_tokens=10,
                             structured_outputs={"choice": ["alpha", "beta", "gamma"]}),
              SamplingParams(temperature=0, max_tokens=40),                # unconstrained
              SamplingParams(temperature=0, max_tokens=20,
                             structured_outputs={"regex": r"[0-9]{3}-[a-z]{2,6}"})]
    batched = smol.generate(prompts, params)
    alone = [smol.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert [o.output_token_ids for o in batched] == [o.output_token_ids for o in alone]
    assert person_problem(json.loads(batched[0].text)) is None
    assert batched[1].text in ("alpha", "beta", "gamma")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,6}", batched[3].text)
    free = smol.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=40))[0]
    assert batched[2].output_token_ids == free.output_token_ids   # untouched by its neighbours
    assert not batched[2].text.startswith("{")


def test_max_tokens_still_cuts_a_constrained_reply(smol):
    out = smol.generate([chat(smol, QUESTIONS[0])], SamplingParams(
        temperature=0, max_tokens=5, structured_outputs={"json": PERSON}))[0]
    assert out.finish_reason is FinishReason.LENGTH and len(out.output_token_ids) == 5
    assert out.text.startswith("{")


def test_logprobs_are_the_masked_distributions_as_vllms(smol):
    """vLLM applies the grammar's bitmask to the logits its sampler (and its raw logprobs) read:
    every token with a finite logprob is one the grammar allows, and their mass is the whole."""
    out = smol.generate([chat(smol, "Yes or no?")], SamplingParams(
        temperature=0, max_tokens=4, logprobs=10,
        structured_outputs={"choice": ["yes", "no"]}))[0]
    first = [t for t in out.logprobs[0]["top_logprobs"] if t["logprob"] > float("-inf")]
    assert first and all(("yes".startswith(t["token"]) or "no".startswith(t["token"]))
                         and t["token"] for t in first), first
    assert sum(torch.tensor(t["logprob"]).exp().item() for t in first) == pytest.approx(1.0,
                                                                                        abs=1e-4)


def test_a_stop_token_id_may_end_a_finished_grammar(smol):
    """The grammar's end allows every stop token (vLLM's all_stop_token_ids: EOS and the
    request's stop_token_ids); a stop token id then ends the request with it as stop_reason."""
    newline = smol.tokenizer.encode("\n")[0]
    out = smol.generate([chat(smol, "Say yes.")], SamplingParams(
        temperature=0, max_tokens=10, stop_token_ids=[newline], logit_bias={newline: 100.0},
        structured_outputs={"choice": ["yes", "no"]}))[0]
    assert out.text in ("yes", "no")
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == newline


def test_a_schema_that_does_not_compile_is_the_requests_error(smol):
    """What passed the tokenizer-free check but does not compile for the model's tokenizer is
    refused at admission, the request alone (an error record; the job goes on)."""
    request = Request("bad", chat(smol, "hi"), SamplingParams(
        max_tokens=4, structured_outputs={"json": {"type": "object"}}))
    # past the check (as a schema xgrammar's parser takes but its compiler refuses would be)
    object.__setattr__(request.sampling.structured_outputs, "json_", {"type": "objectx"})
    with pytest.raises(RequestError, match="structured_outputs: xgrammar cannot compile"):
        smol.add_request(request)
    assert not smol.has_unfinished()


def allowed_ids(step, row: int, vocab: int) -> set[int]:
    words = step.bitmask[row].tolist()
    return {i for i in range(vocab) if (words[i // 32] >> (i % 32)) & 1}


def test_a_new_or_trimmed_row_is_replayed_from_its_output(default_model_dir):
    """The matcher follows the row's output: a sampler that meets a request mid-reply (SiPipe's
    column samplers) or whose output was trimmed replays it, so the mask is the reply's."""
    from batchinfer.engine.tokenizer import _hf_tokenizer, _version

    path = default_model_dir.resolve()
    hf = _hf_tokenizer(str(path), _version(path))
    vocab = len(hf)
    sampler = Sampler(vocab, (hf.eos_token_id,), torch.device("cpu"), tokenizer_source=str(path))
    seq = Sequence(Request("r", [1, 2], SamplingParams(
        temperature=0, structured_outputs={"choice": ["abcd", "abxy"]})))
    text = lambda ids: {hf.decode([i]) for i in ids}  # noqa: E731

    seq.output_token_ids = hf.encode("ab", add_special_tokens=False)    # met mid-reply
    batch = sampler.prepare([seq])
    assert text(allowed_ids(batch.grammar, 0, vocab)) <= {"c", "cd", "x", "xy"}
    tokens, _ = sampler.sample(torch.zeros(1, vocab), batch)
    seq.output_token_ids.append(tokens.item())

    seq.output_token_ids = []                                          # trimmed to nothing
    first = text(allowed_ids(sampler.prepare([seq]).grammar, 0, vocab))
    assert first and all("abcd".startswith(t) or "abxy".startswith(t) for t in first), first
    assert "c" not in first and "x" not in first
    sampler.release("r")
    assert len(sampler.grammars) == 0


def _mixed(engine) -> tuple[list, list]:
    prompts = [chat(engine, q) for q in QUESTIONS]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": PERSON}),
              SamplingParams(temperature=0.9, seed=4, max_tokens=12,
                             structured_outputs={"regex": r"[a-z]{3,8}( [a-z]{3,8})?"}),
              SamplingParams(temperature=0, max_tokens=16),
              SamplingParams(temperature=0, max_tokens=8, logprobs=2,
                             structured_outputs={"choice": ["friend", "foe"]})]
    return prompts, params


def _replies(outs) -> list[tuple]:
    return [(o.output_token_ids, o.text, o.finish_reason) for o in outs]


def test_launching_steps_ahead_gives_the_step_by_step_replies(smol, make_engine):
    """Async scheduling (steps_ahead.py; on CPU its bookkeeping runs as on a GPU): a constrained
    row's next step is prepared before its token is read, with a placeholder in its output."""
    ahead = make_engine(model={"max_model_len": 512}, scheduler={"async_scheduling": True})
    assert ahead.info["async_scheduling"]
    prompts, params = _mixed(smol)
    assert _replies(ahead.generate(prompts, params)) == _replies(smol.generate(prompts, params))


@pytest.mark.slow
def test_pipeline_parallel_replies_equal_the_single_process(smol, make_engine):
    """PP=2 on worker processes: the last stage's sampler loads the tokenizer's xgrammar view
    itself and gives the single process's replies."""
    prompts, params = _mixed(smol)
    reference = _replies(smol.generate(prompts, params))
    with make_engine(model={"max_model_len": 512}, parallel={"pp": 2}) as engine:
        assert _replies(engine.generate(prompts, params)) == reference
    assert reference[3][1] in ("friend", "foe")
