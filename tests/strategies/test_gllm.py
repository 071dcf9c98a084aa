"""gLLM Token Throttling (strategies/gllm/scheduler.py): the formulas on hand-made states, the paper's case
studies (Figs. 7 and 8) as scheduling traces against Sarathi-Serve's fixed budget, and PP=2 runs
on the real model whose greedy outputs equal the baseline's."""
from __future__ import annotations

import pytest

from batchinfer.engine.kv_cache import BlockManager
from batchinfer.runner.recipe import parse_recipe
from batchinfer.runner.recipe_errors import RecipeError
from batchinfer.engine.batching_policies import HybridBatching
from batchinfer.strategies.gllm.scheduler import (GLLMParams, TokenThrottlingScheduler, decode_budget,
                                        is_decoding, prefill_budget)
from batchinfer.sim.scheduler_driver import complete, launch, make_seq, run_pipeline
from tests.strategy_e2e import (E2E_PARAMS, E2E_PROMPTS, TIGHT, assert_context_dependent,
                                 run_shipped_recipe, tight_reference)

DEFAULTS = GLLMParams()


# --- eq. 1-4 ---------------------------------------------------------------------------------------
def test_paper_defaults():
    assert (DEFAULTS.T, DEFAULTS.MaxP, DEFAULTS.MinP, DEFAULTS.KV_thresh) == (8, 2048, 32, 0.05)
    assert DEFAULTS.WT and DEFAULTS.UT and DEFAULTS.decode_throttling


def test_prefill_budget_eq3():
    # plenty waiting, empty cache: #WP / #T binds
    assert prefill_budget(DEFAULTS, 8000, 1.0) == 1000
    # half the cache free: 2048 x (0.5 - 0.05) / 0.95 = 970.1 binds
    assert prefill_budget(DEFAULTS, 8000, 0.5) == 971
    # a lot waiting, empty cache: #MaxP caps
    assert prefill_budget(DEFAULTS, 100_000, 1.0) == 2048
    # little waiting: #MinP floors it, but never more than what waits
    assert prefill_budget(DEFAULTS, 100, 1.0) == 32
    assert prefill_budget(DEFAULTS, 10, 1.0) == 10
    # exactly at the threshold the KV term is 0 and #MinP applies
    assert prefill_budget(DEFAULTS, 8000, 0.05) == 32


def test_prefill_budget_edge_cases():
    assert prefill_budget(DEFAULTS, 0, 1.0) == 0                     # nothing waiting
    assert prefill_budget(DEFAULTS, 8000, 0.049) == 0                # below KV_thresh: suspended
    no_threshold = GLLMParams(KV_thresh=0.0)
    assert prefill_budget(no_threshold, 8000, 0.01) == 32            # eq. 2 floor: #MinP
    assert prefill_budget(no_threshold, 100_000, 0.25) == 512        # eq. 2: 2048 x 0.25


def test_prefill_budget_ablations():
    no_wt = GLLMParams(WT=False)                                      # eq. 2 (+ threshold)
    assert prefill_budget(no_wt, 8000, 1.0) == 2048
    assert prefill_budget(no_wt, 8000, 0.5) == 971
    assert prefill_budget(no_wt, 8000, 0.04) == 0
    no_ut = GLLMParams(UT=False)                                      # eq. 1 (+ threshold)
    assert prefill_budget(no_ut, 8000, 0.1) == 1000
    assert prefill_budget(no_ut, 100_000, 0.1) == 2048
    assert prefill_budget(no_ut, 8000, 0.04) == 0
    neither = GLLMParams(WT=False, UT=False)                          # a fixed #MaxP
    assert prefill_budget(neither, 8000, 0.3) == 2048
    assert prefill_budget(neither, 500, 0.3) == 500


def test_decode_budget_eq4():
    assert decode_budget(512, 4) == 128
    assert decode_budget(10, 4) == 3           # rounded up: every decode within PP micro-batches
    assert decode_budget(1, 2) == 1            # fewer running than the PP depth
    assert decode_budget(0, 2) == 0
    assert decode_budget(7, 1) == 7


# --- the scheduler on hand-made states -----------------------------------------------------------------
def _gllm(num_blocks=64, depth=2, **params) -> TokenThrottlingScheduler:
    return TokenThrottlingScheduler(BlockManager(num_blocks, 16, watermark=0.0),
                                    GLLMParams(**params), max_model_len=512, depth=depth)


def _sarathi(num_blocks=64, budget=2048) -> HybridBatching:
    """Sarathi-Serve: every idle decode, then prefill chunks up to a fixed token budget."""
    return HybridBatching(BlockManager(num_blocks, 16, watermark=0.0), 256, budget, 512)


def _decoding(sched, n: int, depth: int):
    """`n` requests prefilled and decoding (driven until every prompt is done), the pipeline empty."""
    for i in range(n):
        sched.add(make_seq(i, 8, 1000))
    for _ in range(50):
        if not sched.waiting and all(is_decoding(s) for s in sched.running):
            return
        run_pipeline(sched, depth, max_launches=depth)
    raise AssertionError("the prompts never finished prefilling")


def test_nothing_waiting_splits_the_decodes_evenly():
    sched = _gllm(depth=4)
    _decoding(sched, 10, depth=4)
    batches = [launch(sched)[0] for _ in range(4)]
    assert [len(b) for b in batches] == [3, 3, 3, 1]
    assert all(b.phase == "decode" for b in batches)
    assert launch(sched) == []                                       # all ten in flight
    assert sched.last_decision.prefill_budget == 0


def test_fewer_running_than_the_pipeline_depth():
    sched = _gllm(depth=2)
    _decoding(sched, 1, depth=2)
    first = launch(sched)
    assert len(first) == 1 and len(first[0]) == 1
    assert launch(sched) == []                 # the one request is in flight: nothing to run


def test_prefill_suspended_below_the_kv_threshold_while_decodes_go_on():
    sched = _gllm(num_blocks=20, depth=1, KV_thresh=0.25)
    _decoding(sched, 8, depth=1)               # 8 requests x 1 block = 40% used
    assert sched.kv_free == pytest.approx(0.6)
    sched.add(make_seq(50, 32, 4))             # 2 blocks: admitted while free >= 25%
    first = launch(sched)[0]
    assert first.num_prefill_tokens == 32 and first.num_decode_tokens == 8
    complete(sched, first)
    bm = sched.block_manager
    while bm.num_free_blocks > 4:              # a long request takes blocks until 20% are free
        bm.grow("r0", 16 * (len(bm.block_table("r0")) + 1))
    sched.add(make_seq(51, 16, 4))
    batch = launch(sched)[0]
    assert sched.kv_free <= 0.2
    assert batch.num_prefill_tokens == 0 and batch.num_decode_tokens == 9
    assert sched.num_suspended == 1 and len(sched.waiting) == 1
    decision = sched.drain_decisions()[0]
    assert decision["switch"] == "prefill suspended" and "KV_thresh 25.0%" in decision["reason"]


def test_last_prompt_that_does_not_fit_is_chunked():
    sched = _gllm(T=1, MaxP=100, MinP=1, UT=False)
    for i, n in enumerate((40, 40, 40)):
        sched.add(make_seq(i, n, 4))
    batch = launch(sched)[0]
    assert [item.num_tokens for item in batch.items] == [40, 40, 20]
    nxt = launch(sched)
    assert nxt == []                           # the chunked prompt's rest waits for its chunk
    assert sched.num_waiting_tokens == 20


def test_prompts_that_each_hold_part_of_the_cache_do_not_wait_for_each_other():
    """Two 200-token prompts in a 256-token cache, chunked: the older one's next chunk preempts
    the newer one instead of both waiting forever."""
    sched = TokenThrottlingScheduler(BlockManager(16, 16, watermark=0.0),
                                     GLLMParams(T=1, MaxP=128, MinP=8), max_model_len=256, depth=2)
    trace = run_pipeline(sched, 2, {0: [make_seq(0, 200, 4), make_seq(1, 200, 4)]})
    assert not sched.running and not sched.waiting and sched.num_preemptions >= 1
    assert {r for b in trace for r in b.request_ids} == {"r0", "r1"}
    sched.block_manager.check_invariants()


# --- the case studies -----------------------------------------------------------------------------------
def test_figure_7_new_requests_spread_over_the_following_micro_batches():
    """Fig. 7, first situation (PP depth 2, #T = 3): prompts arrive while requests decode.
    Sarathi-Serve prefills them all in one micro-batch and none in the next; gLLM spreads them."""
    traces = {}
    for name, sched in (("sarathi", _sarathi(256)), ("gllm", _gllm(256, T=3, MinP=1))):
        _decoding(sched, 8, depth=2)
        arrivals = {0: [make_seq(100 + i, 96, 40) for i in range(3)]}
        traces[name] = run_pipeline(sched, 2, arrivals, max_launches=6)
    sarathi = traces["sarathi"]
    assert [b.prefill for b in sarathi] == [288, 0, 0, 0, 0, 0]
    # every decode rides in the big micro-batch: nothing is left for the second pipeline slot
    assert [b.decode for b in sarathi] == [8, 11, 11, 11, 11, 11]
    assert {b.in_flight for b in sarathi} == {1}
    # gLLM: #WP / #T of what is not yet scheduled, every micro-batch; 4 decodes each
    assert [b.prefill for b in traces["gllm"][:3]] == [96, 64, 43]
    assert [b.decode for b in traces["gllm"][:2]] == [4, 4]


def test_figure_7_prefill_follows_kv_occupancy():
    """Fig. 7, second situation: enough prompts wait to overfill the cache. Sarathi-Serve fills the
    KV cache in two micro-batches and then preempts; gLLM shrinks its prefill as the cache fills
    and stays below it."""
    def prompts():
        return {0: [make_seq(i, 48, 24) for i in range(12)]}

    sarathi_sched, gllm_sched = _sarathi(32, budget=256), _gllm(32, T=2, MaxP=256, MinP=8)
    sarathi = run_pipeline(sarathi_sched, 2, prompts(), max_launches=400)
    gllm = run_pipeline(gllm_sched, 2, prompts(), max_launches=400)
    assert [b.prefill for b in sarathi[:3]] == [256, 256, 0] and sarathi[1].kv_usage == 1.0
    first = [b.prefill for b in gllm[:3]]
    assert first[0] > first[1] > first[2] > 0                        # 256, 122, 29
    assert max(b.kv_usage for b in gllm) < 1.0
    assert gllm_sched.num_preemptions < sarathi_sched.num_preemptions
    for trace in (sarathi, gllm):                                     # both finish everything
        assert {r for b in trace for r in b.request_ids} == {f"r{i}" for i in range(12)}


def test_figure_8_decode_tokens_balanced_over_the_pipeline():
    """Fig. 8 (PP depth 4): twelve requests decode. Sarathi-Serve's micro-batches take every idle
    decode, so one slot of the four stays empty for good; gLLM gives each of the four #RD / 4."""
    def prompts():
        return {0: [make_seq(i, 16, 30) for i in range(12)]}

    sarathi = run_pipeline(_sarathi(256, budget=64), 4, prompts(), max_launches=40)
    gllm = run_pipeline(_gllm(256, depth=4, T=1, MaxP=64), 4, prompts(), max_launches=40)
    steady = slice(16, 40)
    assert {b.decode for b in sarathi[steady]} == {4}      # 3 micro-batches of 4 in a 4-deep pipe
    assert {b.decode for b in gllm[steady]} == {3}         # 4 micro-batches of 3
    assert len(gllm) == len(sarathi) == 40


def test_decode_throttling_off_takes_every_idle_decode():
    sched = _gllm(depth=4, decode_throttling=False)
    _decoding(sched, 10, depth=4)
    assert [len(launch(sched)[0]) for _ in range(1)] == [10]
    assert launch(sched) == []


# --- recipe and real runs -------------------------------------------------------------------------------
def test_recipe_names_and_checks_the_papers_parameters():
    recipe = parse_recipe({"strategy": {"name": "gllm", "T": 4, "UT": False}, "parallel": {"pp": 2}})
    strategy = recipe.engine_config().strategy
    assert strategy.T == 4 and strategy.UT is False and strategy.MaxP == 2048
    with pytest.raises(RecipeError, match="strategy.KV_tresh"):
        parse_recipe({"strategy": {"name": "gllm", "KV_tresh": 0.1}})
    with pytest.raises(RecipeError, match="strategy.T"):
        parse_recipe({"strategy": {"name": "gllm", "T": 0}})
    with pytest.raises(RecipeError, match="MinP"):
        parse_recipe({"strategy": {"name": "gllm", "MinP": 4096}})


@pytest.mark.slow
def test_pp2_gllm_equals_the_baseline_under_memory_pressure():
    """Requests that need ~3x the KV cache, small #MaxP so prompts are chunked: two pipeline
    stages with throttled hybrid micro-batches give the single process's greedy tokens."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine

    reference = [list(tokens) for tokens in tight_reference()]
    assert_context_dependent(reference)
    config = EngineConfig(**TIGHT, parallel={"pp": 2}, strategy=GLLMParams(T=2, MaxP=48, MinP=8))
    with Engine.from_config(config) as engine:
        outs = engine.generate(E2E_PROMPTS, E2E_PARAMS)
        events = engine.drain_step_events()
        sched = engine.scheduler
        assert engine.info["strategy"] == "gllm"
    assert [o.output_token_ids for o in outs] == reference
    assert isinstance(sched, TokenThrottlingScheduler)
    assert "mixed" in {e["phase"] for e in events}                     # hybrid micro-batches
    assert max(e["num_prefill_tokens"] for e in events) <= 48
    sched.block_manager.check_invariants()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


@pytest.mark.slow
def test_gllm_recipe_runs_out_of_the_box(tmp_path):
    """recipes/gllm.yaml as shipped, on the embedded default, through `batchinfer run`; the report
    shows the tokens per micro-batch."""
    out = tmp_path / "run"
    _, report = run_shipped_recipe("gllm", out, limit=4)
    assert report["strategy"]["name"] == "gllm"
    balance = report["session"]["micro_batch_tokens"]
    assert balance["micro_batches"] > 0 and balance["mean"] > 0
    assert (out / "plots" / "micro_batch_tokens.png").exists()
    assert "## Micro-batch tokens" in (out / "report.md").read_text()
