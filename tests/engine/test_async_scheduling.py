"""Async scheduling (engine/steps_ahead.py): the next step launched before this one's ids are on
the host must give exactly the outputs of step-by-step runs. On CPU the launch runs the forward
at once, but every piece of the bookkeeping is the same: placeholders, the ids taken from the
previous step's sampled tensor, stop checks a step late, a stopped sequence's extra step dropped,
the step-by-step fallback under KV pressure and for penalised requests."""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.cuda_graphs import DecodeGraphs
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.request import PENDING_TOKEN, Request, SamplingParams
from batchinfer.engine.steps_ahead import AsyncInProcessExecutor

PROMPTS = ["Say hi.", "Count from one to five.", "What is the capital of France?",
           "Write one short sentence about the sea.", "Name a colour.", "What is 2 + 2?",
           "Give me a word that rhymes with cat.", "Translate 'thank you' into French."]


def _params() -> list[SamplingParams]:
    """Every stop rule and sampler path without penalties, a different one per prompt."""
    return [SamplingParams(max_tokens=40, temperature=0.0),                       # EOS
            SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),       # length
            SamplingParams(max_tokens=40, temperature=0.0, stop=["."]),           # stop string
            SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=11),   # sampled
            SamplingParams(max_tokens=24, temperature=0.0, logprobs=2),
            SamplingParams(max_tokens=24, temperature=0.7, top_k=20, seed=5, min_tokens=6),
            SamplingParams(max_tokens=3, temperature=0.0),
            SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[13])]


def _chat(engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _outputs(engine, params=None) -> list[tuple]:
    prompts = [_chat(engine, p) for p in PROMPTS]
    outs = engine.generate(prompts, params or _params())
    return [(o.output_token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs)
            for o in outs]


def _engine(make_engine, launch_ahead: bool, kv: str = "256MiB", graphs: bool = False):
    engine = make_engine(model={"max_model_len": 256},
                         device={"device": "cpu", "attention_backend": "torch"},
                         cache={"kv_cache_memory": kv},
                         scheduler={"policy": "hb", "max_num_batched_tokens": 48,
                                    "chunk_size": 32, "async_scheduling": launch_ahead})
    executor = engine.replicas[0].executor
    assert isinstance(executor, AsyncInProcessExecutor) == launch_ahead
    assert engine.info["async_scheduling"] == launch_ahead
    if graphs:    # the graphs' padded decode forward (eager here): ids substituted in its buffer
        executor.graphs = DecodeGraphs(executor.model, executor.kv_caches,
                                       executor.block_manager, torch.device("cpu"), max_batch=64,
                                       max_seq_len_to_capture=512, capture=False)
    return engine


def _assert_same_up_to_padding(got: list[tuple], expected: list[tuple]) -> None:
    """The graphs' forward pads a decode batch to its captured size: the same tokens, text and
    stops, and log-probabilities within float rounding (with two threads a padded GEMM splits
    its rows differently, 1e-5 apart)."""
    assert [o[:4] for o in got] == [o[:4] for o in expected]
    for got_lps, expected_lps in zip((o[4] for o in got), (o[4] for o in expected)):
        assert (got_lps is None) == (expected_lps is None)
        for g, e in zip(got_lps or [], expected_lps or []):
            assert [t["token_id"] for t in g["top_logprobs"]] == \
                [t["token_id"] for t in e["top_logprobs"]]
            assert g["logprob"] == pytest.approx(e["logprob"], abs=1e-4)
            assert [t["logprob"] for t in g["top_logprobs"]] == pytest.approx(
                [t["logprob"] for t in e["top_logprobs"]], abs=1e-4)


@pytest.fixture(scope="module")
def step_by_step_engine(make_engine):
    """One step-by-step engine (256MiB of KV) for every test here that only generates with it."""
    return _engine(make_engine, False)


@pytest.fixture(scope="module")
def launch_ahead_engine(make_engine):
    """One launch-ahead engine (256MiB of KV) for the tests that only generate with it or spy
    on its executor through monkeypatch."""
    return _engine(make_engine, True)


@pytest.fixture(scope="module")
def step_by_step(step_by_step_engine):
    return _outputs(step_by_step_engine)


@pytest.mark.slow
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-forward"])
def test_launching_ahead_gives_the_step_by_step_outputs(make_engine, launch_ahead_engine,
                                                        step_by_step, graphs):
    engine = _engine(make_engine, True, graphs=True) if graphs else launch_ahead_engine
    engine.drain_step_events()
    tokens_before = engine.stats()["generation_tokens"]
    ahead = _outputs(engine)
    if graphs:
        _assert_same_up_to_padding(ahead, step_by_step)
    else:
        assert ahead == step_by_step
    reasons = {o[2].value for o in ahead}
    assert {"stop", "length"} <= reasons       # the prompts did reach both kinds of stop
    events = engine.drain_step_events()
    assert all(PENDING_TOKEN not in o[0] for o in ahead)
    assert engine.stats()["generation_tokens"] - tokens_before == sum(len(o[0]) for o in ahead)
    if graphs:
        assert engine.replicas[0].executor.graphs.steps > 0
    assert len(events) > 10


def test_two_steps_are_in_flight_and_ids_come_from_the_device(launch_ahead_engine, monkeypatch):
    engine = launch_ahead_engine
    executor = engine.replicas[0].executor
    seen = []
    submit = executor.submit

    def spy(batch):
        submit(batch)
        seen.append(executor.num_in_flight)

    monkeypatch.setattr(executor, "submit", spy)
    prompts = [_chat(engine, p) for p in PROMPTS[:3]]
    engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert max(seen) == 2


@pytest.mark.slow
def test_under_kv_pressure_and_with_penalties_it_falls_back_step_by_step(
        make_engine, step_by_step_engine, launch_ahead_engine):
    tight = "16MiB"       # 364 tokens for 8 x ~59: preemptions happen (5 of them)
    long = [p.with_overrides(max_tokens=24, ignore_eos=True, stop=None, stop_token_ids=None)
            for p in _params()]
    reference = _engine(make_engine, False, kv=tight)
    expected = _outputs(reference, long)
    assert reference.stats()["num_preemptions"] > 0
    assert _outputs(_engine(make_engine, True, kv=tight), long) == expected

    penalised = [p.with_overrides(repetition_penalty=1.3) if i % 2 else p
                 for i, p in enumerate(_params())]
    engine = launch_ahead_engine
    assert _outputs(engine, penalised) == _outputs(step_by_step_engine, penalised)
    assert engine._ahead.penalised == 0         # every penalised request counted out again


@pytest.mark.slow
def test_prompt_logprobs_and_bad_words_launching_ahead(step_by_step_engine,
                                                      launch_ahead_engine):
    """Prompt scores come back with their launched chunks (48-token steps: long prompts in two),
    and a request with bad words (the sampler reads its reply's tokens) falls back step by step:
    the step-by-step outputs, and every such request counted out again."""
    params = [p.with_overrides(prompt_logprobs=2) if i % 3 == 0 else
              p.with_overrides(bad_words=["the", "Paris"]) if i % 3 == 1 else p
              for i, p in enumerate(_params())]
    prompts = [_chat(launch_ahead_engine, p * (1 + i % 3)) for i, p in enumerate(PROMPTS)]
    assert max(len(p) for p in prompts) > 48
    expected = step_by_step_engine.generate(prompts, params)
    got = launch_ahead_engine.generate(prompts, params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in expected]
    assert [o.prompt_logprobs for o in got] == [o.prompt_logprobs for o in expected]
    assert sum(o.prompt_logprobs is not None for o in got) == 3
    assert launch_ahead_engine._ahead.penalised == 0


def test_abort_leaves_no_placeholder(make_engine):
    engine = _engine(make_engine, True)
    for i, text in enumerate(PROMPTS[:4]):
        engine.add_request(Request(f"r{i}", _chat(engine, text),
                                   SamplingParams(max_tokens=50, temperature=0.0,
                                                  ignore_eos=True)))
    for _ in range(4):
        engine.step()
    engine._fill(engine.replicas[0])    # launched, not collected (on CPU step() collects both)
    assert engine.replicas[0].executor.num_in_flight == 2
    outs = engine.abort_all()
    assert len(outs) == 4
    assert all(PENDING_TOKEN not in o.output_token_ids for o in outs)
    assert all(o.finish_reason.value == "abort" for o in outs)


def test_asked_for_where_it_cannot_run_names_the_key(make_engine):
    with pytest.raises(ConfigError, match="scheduler.async_scheduling.*prefix caching"):
        make_engine(device={"device": "cpu"},
                    cache={"kv_cache_memory": "64MiB", "enable_prefix_caching": True},
                    scheduler={"async_scheduling": True})
    off = make_engine(model={"max_model_len": 256}, device={"device": "cpu"},
                      cache={"kv_cache_memory": "64MiB"})
    assert off.info["async_scheduling"] is False       # CPU: nothing to overlap


def test_an_id_reused_while_its_last_step_is_out_keeps_its_blocks(make_engine,
                                                                   step_by_step_engine):
    """A request stops on a stop token, which the host sees a step late, so one more step of it
    is still running; a new request takes the same id before that step comes back. The late
    step must not free the new request's blocks (the scheduler frees by id)."""
    plain = step_by_step_engine
    first, second, other = (_chat(plain, p) for p in PROMPTS[1:4])
    free_run = plain.generate([first], SamplingParams(max_tokens=12, temperature=0.0,
                                                      ignore_eos=True))[0].output_token_ids
    at = next(i for i in range(3, 12) if free_run[i] not in free_run[:i])
    stopping = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[free_run[at]])
    short = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = {"first": free_run[:at + 1],
                "second": plain.generate([second], short)[0].output_token_ids,
                "other": plain.generate([other], short)[0].output_token_ids}

    engine = _engine(make_engine, True)
    executor = engine.replicas[0].executor
    ready, collect, collected = executor.ready, executor.collect, []
    # as on a GPU: one step comes back per engine step, the one launched after it still runs
    executor.ready = lambda: not collected and ready()
    executor.collect = lambda: collected.append(1) or collect()

    def run_until(done) -> dict:
        outs = {}
        while not done(outs):
            collected.clear()
            outs.update((o.request_id, o) for o in engine.step())
        return outs

    engine.add_request(Request("a", first, stopping))
    engine.add_request(Request("b", other, short))
    outs = run_until(lambda outs: "a" in outs)
    assert outs["a"].output_token_ids == expected["first"]
    assert any(item.seq.request_id == "a" for step in executor._launched
               for item in step.batch.items)         # its extra step has not come back
    engine.add_request(Request("a", second, short))  # the id is free: the request finished
    outs.update(run_until(lambda _: not engine.has_unfinished()))
    assert outs["a"].output_token_ids == expected["second"]
    assert outs["b"].output_token_ids == expected["other"]
    block_manager = engine.scheduler.block_manager
    block_manager.check_invariants()
    assert block_manager.num_free_blocks == block_manager.num_blocks
