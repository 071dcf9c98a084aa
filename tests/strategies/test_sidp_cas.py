"""SiDP's Compute-as-a-Service parts: the mode switch (threshold, patience, hysteresis), B_th from
measured costs, the orchestrator's rounds, and SmolLM2 DP=2 end to end in CaS, across switches
and with a replica that has no work."""
from __future__ import annotations

import pytest

from batchinfer.engine.request import Request, SamplingParams
from batchinfer.engine.step_plan import StepPlan
from batchinfer.strategies.sidp.mode_switch import CAS, WAS, ModeSwitch, profiled_threshold
from batchinfer.strategies.sidp.orchestrator import DUMMY_MB, Orchestrator, RoundPlan


# --- the mode switch ------------------------------------------------------------------------------
def test_switches_after_patience_and_holds_inside_the_hysteresis_band():
    switch = ModeSwitch(threshold=8, patience=3, hysteresis=2.0)
    modes = [switch.observe(b) for b in [64, 5, 5, 9, 5, 5]]
    assert modes == [WAS] * 6                    # the streak below 8 was broken by 9
    assert switch.observe(5) == CAS              # third in a row
    # between B_th and 2 x B_th: stays CaS (no flapping around the threshold)
    assert [switch.observe(b) for b in [8, 12, 15, 9, 12, 15, 8]] == [CAS] * 7
    assert [switch.observe(b) for b in [16, 40]] == [CAS, CAS]
    assert switch.observe(16) == WAS
    assert switch.switches == 2
    assert switch.iterations == {WAS: 7, CAS: 10}
    timeline = switch.summary()["mode_timeline"]
    assert [(s["mode"], s["iterations"]) for s in timeline] == [
        (WAS, [0, 6]), (CAS, [7, 16])]
    assert timeline[0]["batch"] == [5, 64] and timeline[1]["batch"] == [8, 40]


def test_was_only_never_switches():
    switch = ModeSwitch(threshold=8, patience=1, enabled=False)
    assert {switch.observe(b) for b in [1, 0, 2, 1]} == {WAS}
    assert switch.switches == 0 and switch.summary()["cas_iteration_share"] == 0.0


def test_threshold_from_the_profiled_modes():
    was = {1: 70e-3, 2: 71e-3, 4: 74e-3, 8: 80e-3, 16: 95e-3}
    cas = {1: 50e-3, 2: 55e-3, 4: 65e-3, 8: 80e-3, 16: 115e-3}
    assert profiled_threshold(was, cas) == 8            # the first batch where WaS is no slower
    assert profiled_threshold(was, {b: 0.0 for b in was}) == 32   # CaS wins everywhere
    assert profiled_threshold(was, {b: 1.0 for b in was}) == 1    # WaS wins everywhere


# --- the orchestrator, with a recording pool --------------------------------------------------
class _Pool:
    def __init__(self):
        self.sent: list[tuple[int, StepPlan]] = []

    def send(self, rank, message):
        self.sent.append((rank, message[1]))


class _Executor:
    def __init__(self, orchestrator, replica):
        self.orchestrator, self.replica, self.num_sent = orchestrator, replica, 0
        orchestrator.executors[replica] = self

    def mark_sent(self, mb_id, cas):
        self.num_sent += 1

    def result_arrived(self):
        return False


def _plan(mb_id: int, tokens: int) -> StepPlan:
    return StepPlan(mb_id, [1] * tokens, [tokens], [tokens], [[0]], [0], [f"r{mb_id}"], [0])


@pytest.mark.parametrize("dummy_skipping", [True, False])
def test_cas_rounds_wait_for_every_replica_and_give_idle_ones_dummies(dummy_skipping):
    pool = _Pool()
    orchestrator = Orchestrator(pool, 3, ModeSwitch(threshold=4, patience=1), dummy_skipping)
    executors = [_Executor(orchestrator, r) for r in range(3)]
    orchestrator.submit(0, _plan(0, 2))               # WaS: out at once
    assert [r for r, _ in pool.sent] == [0]
    orchestrator.flush()                              # effective batch 2 < 4 -> CaS from now
    assert orchestrator.mode == CAS
    orchestrator.submit(1, _plan(1, 3))
    orchestrator.flush()                              # replica 0's plan is still out: held
    assert len(pool.sent) == 1 and orchestrator.is_held(1)
    executors[0].num_sent = 0                         # its result was collected
    orchestrator.submit(0, _plan(2, 1))
    orchestrator.flush()
    round_plans = dict(pool.sent[1:])
    assert sorted(round_plans) == [0, 1, 2]
    rows = [1, 3, 0] if dummy_skipping else [1, 3, 1]
    assert all(isinstance(p, RoundPlan) and p.cas_rows == rows for p in round_plans.values())
    assert round_plans[2].mb_id == DUMMY_MB and round_plans[2].num_tokens == 0
    assert round_plans[0].input_ids == [1] and round_plans[1].mb_id == 1
    assert executors[2].num_sent == 0                  # a dummy has no result to wait for
    assert orchestrator.summary()["cas_rounds"] == 1


def test_the_switch_reads_the_group_batch_not_the_largest_replica_share():
    """Each replica below B_th is not the tail: a round would fuse every replica's rows into one
    owner's GEMMs, so the group stays in WaS until the rows of all replicas together fall below."""
    pool = _Pool()
    orchestrator = Orchestrator(pool, 3, ModeSwitch(threshold=8, patience=1))
    executors = [_Executor(orchestrator, r) for r in range(3)]
    for replica in range(3):
        orchestrator.submit(replica, _plan(replica, 3))
    orchestrator.flush()                              # 3 + 3 + 3 = 9 >= 8: WaS
    assert orchestrator.mode == WAS and len(pool.sent) == 3
    for replica in (1, 2):                            # two replicas ran dry
        executors[replica].num_sent = 0
    executors[0].num_sent = 0
    orchestrator.submit(0, _plan(3, 5))
    orchestrator.flush()                              # 5 + 0 + 0 < 8: the tail, CaS
    assert orchestrator.mode == CAS


def test_a_held_plan_goes_when_forced():
    pool = _Pool()
    orchestrator = Orchestrator(pool, 2, ModeSwitch(threshold=4, patience=1))
    executors = [_Executor(orchestrator, r) for r in range(2)]
    orchestrator.switch.mode = CAS
    executors[1].num_sent = 1                         # outstanding elsewhere
    orchestrator.submit(0, _plan(0, 2))
    orchestrator.flush()
    assert not pool.sent and orchestrator.waiting_on_others(0)
    orchestrator.flush(force=True)
    assert [(r, p.cas_rows) for r, p in pool.sent] == [(0, [2, 0]), (1, [2, 0])]


# --- end to end: SmolLM2, DP=2 ---------------------------------------------------------------------
PROMPTS = ["Hi", "The capital of France is", "Write a haiku about the sea. " * 6,
           "List three prime numbers:", "1, 2, 3,", "Name a color:"]
BASE = {"cache": {"kv_cache_memory": "32MiB"}, "model": {"max_model_len": 512},
        "parallel": {"dp": 2}}


def _requests(prefix: str, prompts, tokenizer, lengths):
    return [Request(f"{prefix}{i}", tokenizer.encode(p),
                    SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lengths))]


def _run(engine, waves, add_when=None):
    """Adds the first wave, steps; each later wave once `add_when(engine)` holds (or at once)."""
    outputs, waves = {}, list(waves)
    for request in waves.pop(0):
        engine.add_request(request)
    while engine.has_unfinished() or waves:
        if waves and (add_when is None or add_when(engine) or not engine.has_unfinished()):
            for request in waves.pop(0):
                engine.add_request(request)
        for out in engine.step():
            outputs[out.request_id] = out.output_token_ids
    return outputs


def _service_stats(engine, rounds: int) -> list[dict]:
    """Each replica's CaS counters, once every replica has reported every round."""
    import time

    deadline = time.monotonic() + 30
    while True:
        per = engine.stats()["strategy_stats"]["compute_service_per_replica"]
        if all(s.get("rounds", 0) + s.get("dummy_rounds", 0) == rounds for s in per):
            return per
        assert time.monotonic() < deadline, per
        time.sleep(0.05)


@pytest.fixture(scope="module")
def plain_dp_runs():
    """Plain DP's greedy tokens, one engine for the module: (the two waves', the one request's
    of test_a_replica_with_no_work_triggers_no_transfer_in_cas)."""
    import os

    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine

    os.environ["BATCHINFER_LINEAR_KERNEL"] = "torch"   # SiDP's FFN GEMMs are plain torch linears
    try:
        with Engine.from_config(EngineConfig(**BASE)) as engine:
            tok = engine.tokenizer
            waves = [_requests("a", PROMPTS, tok, [12, 30, 8, 40, 20, 16]),
                     _requests("b", PROMPTS[:4], tok, [10, 6, 14, 9])]
            one = engine.generate(["The capital of France is"], SamplingParams(
                max_tokens=8, temperature=0.0, ignore_eos=True))[0].output_token_ids
            return _run(engine, waves), one
    finally:
        del os.environ["BATCHINFER_LINEAR_KERNEL"]


@pytest.fixture(scope="module")
def plain_dp_outputs(plain_dp_runs):
    return plain_dp_runs[0]


@pytest.fixture(scope="module")
def plain_dp_one_request(plain_dp_runs):
    return plain_dp_runs[1]


def _sidp(make_engine, **knobs):
    from batchinfer.strategies.sidp.params import SiDPParams

    knobs.setdefault("weight_slots", True)   # the paper's WaS side, slots across the switches
    params = SiDPParams(**knobs)
    return make_engine(**BASE, strategy=params, scheduler=params.scheduler_config())


@pytest.mark.slow
def test_cas_greedy_outputs_equal_plain_dp_in_cas_and_across_switches(
        make_engine, monkeypatch, plain_dp_outputs):
    """B_th 4, patience 2: decode batches of 3 or less go to CaS; the second wave's prefill (many
    tokens) brings the group back to WaS, its tail to CaS again."""
    monkeypatch.setenv("BATCHINFER_LINEAR_KERNEL", "torch")
    with _sidp(make_engine, batch_threshold=4, mode_switch_patience=2,
               mode_switch_hysteresis=1.0) as engine:
        orchestrator = engine.replicas[0].executor.orchestrator
        tok = engine.tokenizer
        waves = [_requests("a", PROMPTS, tok, [12, 30, 8, 40, 20, 16]),
                 _requests("b", PROMPTS[:4], tok, [10, 6, 14, 9])]
        got = _run(engine, waves, add_when=lambda e: orchestrator.mode == CAS
                   and orchestrator.rounds >= 3)
        stats = engine.stats()["strategy_stats"]
        per = _service_stats(engine, stats["cas_rounds"])
        step_modes = {event.get("mode") for event in engine.drain_step_events()}
    assert got == plain_dp_outputs
    assert step_modes == {WAS, CAS}                   # each step says how it ran (Fig. 15)
    assert stats["mode_switches"] >= 3                # WaS -> CaS -> WaS -> CaS
    assert [s["mode"] for s in stats["mode_timeline"]][:4] == [WAS, CAS, WAS, CAS]
    assert stats["cas_rounds"] >= 6
    assert sum(s["activations_sent"] for s in per) > 0
    assert sum(s["fused_gemms"] for s in per) > 0     # rounds where both replicas had rows


@pytest.mark.parametrize("dummy_skipping", [True, False])
@pytest.mark.slow
def test_a_replica_with_no_work_triggers_no_transfer_in_cas(make_engine, monkeypatch,
                                                           plain_dp_one_request, dummy_skipping):
    """One request: one replica runs it, the other is a dummy in every round. With dummy
    skipping the dummy sends no activation and the owner computes none of its rows; without,
    it pushes a zero row through every layer."""
    monkeypatch.setenv("BATCHINFER_LINEAR_KERNEL", "torch")
    expected = plain_dp_one_request
    with _sidp(make_engine, batch_threshold=10_000, mode_switch_patience=1,
               dummy_skipping=dummy_skipping) as engine:
        out = engine.generate(["The capital of France is"], SamplingParams(
            max_tokens=8, temperature=0.0, ignore_eos=True))[0].output_token_ids
        stats = engine.stats()["strategy_stats"]
        per = _service_stats(engine, stats["cas_rounds"])
    assert out == expected
    worker, dummy = sorted(per, key=lambda s: -s["rounds"])
    assert dummy["rounds"] == 0 and dummy["dummy_rounds"] == stats["cas_rounds"] > 0
    if dummy_skipping:
        assert dummy["activations_sent"] == 0 and worker["rows_served"] == 0
        assert worker["fused_gemms"] == 0
        assert dummy["outputs_returned"] == worker["activations_sent"] > 0
    else:
        assert dummy["activations_sent"] == 15 * stats["cas_rounds"]   # its 15 remote layers
        assert worker["rows_served"] == dummy["activations_sent"]


@pytest.mark.slow
def test_cas_without_gemm_fusion_gives_the_same_tokens(make_engine, monkeypatch, plain_dp_outputs):
    """The owner runs one GEMM chain per replica instead of one over all rows."""
    monkeypatch.setenv("BATCHINFER_LINEAR_KERNEL", "torch")
    with _sidp(make_engine, batch_threshold=10_000, mode_switch_patience=1,
               gemm_fusion=False) as engine:
        tok = engine.tokenizer
        got = _run(engine, [_requests("a", PROMPTS, tok, [12, 30, 8, 40, 20, 16])])
        stats = engine.stats()["strategy_stats"]
        per = _service_stats(engine, stats["cas_rounds"])
    assert got == {k: v for k, v in plain_dp_outputs.items() if k.startswith("a")}
    assert stats["cas_rounds"] > 0 and sum(s["fused_gemms"] for s in per) == 0
    assert sum(s["rows_served"] for s in per) > 0
