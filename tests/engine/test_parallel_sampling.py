"""Parallel sampling (SamplingParams.n > 1, engine/parallel_sampling.py) through the engine,
SmolLM2 fp32: child i samples as an n = 1 request seeded seed + i (vLLM 0.32's rule, checked
against it), each stops on its own, the prompt is computed once (its blocks shared, or served
by the prefix cache), greedy samples are one reply repeated, unseeded ones are not
deduplicated; ids, aborts mid-group and a failed sample."""
from __future__ import annotations

import pytest

from batchinfer.engine.errors import RequestError
from batchinfer.engine.parallel_sampling import ParallelOutput, child_id, gather
from batchinfer.engine.request import FinishReason, Request, RequestOutput, SamplingParams

# 70-odd tokens: several full KV blocks and a partial one
PROMPT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the "
          "steps and listening to the sea, until one night he found a letter on the lamp. "
          "Nobody had been up there for years, and the wax seal bore a crest he knew from his "
          "grandmother's stories about the shipwreck of 1893. The letter said")


@pytest.fixture(scope="module")
def smol(make_engine):
    return make_engine(model={"max_model_len": 512})


def _prefill(engine) -> int:
    return engine.stats()["computed_prefill_tokens"]


def _idle_and_whole(engine) -> None:
    """Nothing left running, every block back (shared ones released by each holder)."""
    assert not engine.has_unfinished()
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_seeded_samples_are_n1_requests_seeded_seed_plus_index_and_share_the_prompt(smol):
    """A seeded n = 3 request gives the replies of three n = 1 requests seeded 11, 12, 13; the
    prompt is computed once (the other samples compute its last partial block only), and
    samples that start from the shared blocks give the same tokens as whole prefills do."""
    block = smol.scheduler.block_manager.block_size
    before = _prefill(smol)
    out, = smol.generate([PROMPT], SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=10))
    prefill = _prefill(smol) - before
    prompt_len = len(out.prompt_token_ids)
    assert prompt_len > 3 * block
    singles = smol.generate([PROMPT] * 3, [SamplingParams(temperature=0.9, seed=11 + i,
                                                          max_tokens=10) for i in range(3)])
    assert isinstance(out, ParallelOutput) and out.request_id == "generate-1"
    assert [s.request_id for s in out.samples] == [child_id("generate-1", i) for i in range(3)]
    assert [s.output_token_ids for s in out.samples] == [s.output_token_ids for s in singles]
    assert [s.text for s in out.samples] == [s.text for s in singles]
    assert len({tuple(s.output_token_ids) for s in out.samples}) == 3
    assert out.text == out.samples[0].text and out.output_token_ids == out.samples[0].output_token_ids
    assert out.num_output_tokens == sum(len(s.output_token_ids) for s in out.samples) == 30
    remainder = prompt_len - (prompt_len - 1) // block * block
    assert prefill == prompt_len + 2 * remainder < prompt_len + 2 * block
    _idle_and_whole(smol)


def test_four_samples_prefill_about_one_prompt(smol):
    """The issue's measure: one n = 4 request computes about one prompt's tokens, four n = 1
    requests of it four."""
    before = _prefill(smol)
    out, = smol.generate([PROMPT], SamplingParams(n=4, temperature=1.0, max_tokens=4))
    grouped = _prefill(smol) - before
    before = _prefill(smol)
    smol.generate([PROMPT] * 4, SamplingParams(temperature=1.0, max_tokens=4))
    apart = _prefill(smol) - before
    prompt_len = len(out.prompt_token_ids)
    assert apart == 4 * prompt_len
    assert grouped < prompt_len + 3 * smol.scheduler.block_manager.block_size < 2 * prompt_len
    _idle_and_whole(smol)


def test_every_sample_stops_on_its_own(smol):
    """Stop strings, EOS and max_tokens per sample: each equals its n = 1 request's reply."""
    params = SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=24, stop=["."])
    out, = smol.generate(["The capital of France is"], params)
    singles = smol.generate(["The capital of France is"] * 6, [
        params.model_copy(update={"n": 1, "seed": 3 + i}) for i in range(6)])
    got = [(s.text, s.output_token_ids, s.finish_reason, s.stop_reason) for s in out.samples]
    assert got == [(s.text, s.output_token_ids, s.finish_reason, s.stop_reason) for s in singles]
    assert len({len(s.output_token_ids) for s in out.samples}) > 1      # they ended apart
    assert any(s.stop_reason == "." for s in out.samples)
    _idle_and_whole(smol)


@pytest.mark.parametrize("policy", ["hb", "sb"])
def test_samples_waiting_for_a_seat_keep_the_prompts_blocks(make_engine, policy):
    """max_num_seqs 2: the third and fourth samples wait for a seat holding the first's prompt
    blocks (they used to give them back and compute the whole prompt), and still give the
    replies of their n = 1 requests."""
    params = SamplingParams(n=4, temperature=0.9, seed=30, max_tokens=5)
    with make_engine(model={"max_model_len": 512}, cache={"kv_cache_memory": "32MiB"},
                     scheduler={"policy": policy, "max_num_seqs": 2}) as engine:
        out, = engine.generate([PROMPT], params)
        prefill = _prefill(engine)
        singles = engine.generate([PROMPT] * 4, [params.model_copy(update={"n": 1, "seed": 30 + i})
                                                 for i in range(4)])
        _idle_and_whole(engine)
    block = 16
    assert prefill < len(out.prompt_token_ids) + 3 * block
    assert [s.output_token_ids for s in out.samples] == [s.output_token_ids for s in singles]


def test_greedy_samples_are_one_reply_computed_once(smol):
    before = smol.stats()["generation_tokens"]
    out, = smol.generate([PROMPT], SamplingParams(n=2, temperature=0.0, max_tokens=9))
    generated = smol.stats()["generation_tokens"] - before
    single, = smol.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=9))
    assert [s.output_token_ids for s in out.samples] == [single.output_token_ids] * 2
    assert [s.request_id for s in out.samples] == [child_id(out.request_id, i) for i in (0, 1)]
    assert generated == 9 and out.num_output_tokens == 18
    _idle_and_whole(smol)


def test_unseeded_samples_are_each_drawn(smol):
    """Unseeded samples are never one reply copied: each is generated, and they differ."""
    before = smol.stats()["generation_tokens"]
    out, = smol.generate([PROMPT], SamplingParams(n=4, temperature=1.0, max_tokens=8,
                                                  ignore_eos=True))
    assert smol.stats()["generation_tokens"] - before == 32 == out.num_output_tokens
    assert len({tuple(s.output_token_ids) for s in out.samples}) > 1


def test_a_scheduler_that_cannot_share_blocks_gets_every_sample_at_once(smol):
    """forks_prompt_blocks False (a scheduler whose KV moves between layouts): each sample
    computes the prompt; the replies are the same."""
    reference, = smol.generate([PROMPT], SamplingParams(n=3, temperature=0.9, seed=5,
                                                        max_tokens=6))
    smol.scheduler.forks_prompt_blocks = False
    try:
        before = _prefill(smol)
        out, = smol.generate([PROMPT], SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=6))
        assert _prefill(smol) - before == 3 * len(out.prompt_token_ids)
    finally:
        del smol.scheduler.forks_prompt_blocks
    assert [s.output_token_ids for s in out.samples] == \
        [s.output_token_ids for s in reference.samples]


def test_ids_of_a_request_and_its_samples_are_taken_while_it_runs(smol):
    ids = smol.tokenizer.encode(PROMPT)
    smol.add_request(Request("a", ids, SamplingParams(n=2, seed=1, max_tokens=3)))
    for taken, n in [("a", 1), ("0_a", 1), ("1_a", 1)]:
        with pytest.raises(RequestError) as exc:
            smol.add_request(Request(taken, ids, SamplingParams(n=n)))
        assert exc.value.code == "duplicate_id" and repr(taken) in exc.value.message
    smol.add_request(Request("1_b", ids, SamplingParams(max_tokens=2)))
    with pytest.raises(RequestError, match="'1_b' is already running"):    # b's second sample
        smol.add_request(Request("b", ids, SamplingParams(n=2, max_tokens=2)))
    done = []
    while smol.has_unfinished():
        done.extend(smol.step())
    assert sorted(o.request_id for o in done) == ["1_b", "a"]
    _idle_and_whole(smol)


def test_abort_mid_group_gives_one_result_per_request(smol):
    """abort_all with samples running, finished and held back: one aborted result per
    request, every block back, and the engine runs on."""
    ids = smol.tokenizer.encode(PROMPT)
    smol.add_request(Request("x", ids, SamplingParams(n=3, seed=2, max_tokens=40,
                                                      ignore_eos=True)))
    smol.add_request(Request("y", ids[:20], SamplingParams(n=2, temperature=0.0, max_tokens=2)))
    done = smol.step()           # x's first sample prefills; the others wait for its blocks
    aborted = smol.abort_all()
    assert done == [] and sorted(o.request_id for o in aborted) == ["x", "y"]
    assert all(o.finish_reason is FinishReason.ABORT for o in aborted)
    _idle_and_whole(smol)
    assert smol.generate(["Hi"], SamplingParams(n=2, seed=0, max_tokens=2))[0].samples


def test_a_failed_sample_fails_the_request_naming_it():
    request = Request("r", [1, 2, 3], SamplingParams(n=3, seed=0))

    def reply(i, **kw):
        return RequestOutput(child_id("r", i), [1, 2, 3], [4, 5], "ab", FinishReason.LENGTH,
                             first_token_time=1.0 + i, finish_time=2.0 + i, **kw)

    ok = gather(request, [reply(0), reply(1), reply(2)], arrival_time=0.5)
    assert ok.finish_reason is FinishReason.LENGTH and ok.error is None
    assert (ok.first_token_time, ok.finish_time, ok.num_output_tokens) == (1.0, 4.0, 6)
    bad = gather(request, [reply(0), reply(1, error="worker lost"), reply(2)], arrival_time=0.5)
    assert bad.error == "sample 1 of 3: worker lost"
    failed = reply(2)
    failed.finish_reason, failed.error = FinishReason.ERROR, "refused"
    worst = gather(request, [reply(0), reply(1), failed], arrival_time=0.5)
    assert worst.finish_reason is FinishReason.ERROR and worst.error == "sample 2 of 3: refused"


@pytest.mark.slow
def test_prefix_caching_serves_the_samples_the_same_replies(make_engine, smol):
    """With prefix caching on the other samples match the first one's cached blocks instead
    of sharing its table: the same replies, the prompt computed about once."""
    params = SamplingParams(n=4, temperature=0.8, seed=21, max_tokens=8)
    reference, = smol.generate([PROMPT], params)
    with make_engine(model={"max_model_len": 512},
                     cache={"kv_cache_memory": "64MiB", "enable_prefix_caching": True}) as cached:
        out, = cached.generate([PROMPT], params)
        block = cached.scheduler.block_manager.block_size
        assert _prefill(cached) < len(out.prompt_token_ids) + 3 * block
        assert cached.stats()["prefix_cache"]["hit_tokens"] >= 3 * block
    assert [s.output_token_ids for s in out.samples] == \
        [s.output_token_ids for s in reference.samples]


@pytest.mark.slow
def test_samples_under_preemption_equal_their_n1_requests():
    """A KV cache ~3x too small: samples sharing prompt blocks are preempted and recomputed,
    and each still equals its n = 1 request's reply. A 2-layer, hidden-size-64 dummy model with
    TIGHT's capacity (224 tokens; ~30 preemptions, as SmolLM2 under TIGHT), at a fraction of
    SmolLM2's compute: the test is about the samples' blocks and seeds, not the weights."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from tests.strategy_e2e import E2E_PROMPTS

    tiny = {"load_format": "dummy", "max_model_len": 128,
            "hf_overrides": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}}
    params = [SamplingParams(n=2, temperature=0.8, seed=100 * i, max_tokens=16 + i % 3 * 10,
                             ignore_eos=True) for i in range(len(E2E_PROMPTS))]
    # 512 bytes of KV a token: 114 KiB holds TIGHT's 224 tokens
    with Engine.from_config(EngineConfig(model=tiny, cache={"kv_cache_memory": "114KiB"})) as engine:
        grouped = engine.generate(E2E_PROMPTS, params)
        assert engine.stats()["num_preemptions"] > 0
        singles = engine.generate(
            [p for p in E2E_PROMPTS for _ in range(2)],
            [sp.model_copy(update={"n": 1, "seed": sp.seed + i}) for sp in params for i in range(2)])
        _idle_and_whole(engine)
    assert [s.output_token_ids for o in grouped for s in o.samples] == \
        [o.output_token_ids for o in singles]


@pytest.mark.parametrize("policy", ["hb", "sb"])
def test_waiting_samples_let_their_blocks_go_when_nothing_runs(policy):
    """Samples waiting with their first sample's prompt blocks (that sample gone) hold most of
    a small pool and nothing runs: the head is admitted once the others let theirs go (they
    compute their prompts later) instead of the engine stalling; running ones keep theirs."""
    from batchinfer.engine.kv_cache import BlockManager
    from batchinfer.engine.batching_policies import make_scheduler
    from batchinfer.sim.scheduler_driver import make_seq

    bm = BlockManager(num_blocks=6, block_size=4)
    sched = make_scheduler(policy, bm, 8, 64, 64)
    samples = [make_seq(i, 9, 4) for i in range(3)]
    for seq in samples:                  # each holds two shared blocks of a finished first
        bm.grow("first", 8)
        bm.share(seq.request_id, bm.block_table("first"))
        bm.free("first")
        seq.num_computed_tokens = 8
        sched.add(seq)
    assert bm.num_free_blocks == 0
    batch, = sched.schedule()
    assert [(item.seq.request_id, item.num_tokens) for item in batch.items][0] == ("r0", 1)
    assert [s.num_computed_tokens for s in samples] == [8, 0, 0]
    bm.check_invariants()
