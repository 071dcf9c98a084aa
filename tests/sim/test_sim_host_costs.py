"""The simulator's host-side work per step (SiPipe §3.1's bubbles): a rank's input preparation
before its forward (or ahead of it, token-safe), the default sampler's host work and kernels on a
GPU preset, SiPipe's CPU samplers on their cores, and the sampling knobs reaching the cost model."""
from __future__ import annotations

import pytest

from batchinfer.engine.config import EngineConfig
from batchinfer.runner.recipe import strategy_class
from batchinfer.engine.request import Request, SamplingParams, Sequence
from batchinfer.engine.scheduler import MicroBatch, ScheduledSeq
from batchinfer.sim.cost_model import BatchShape
from batchinfer.sim.executor import SimulatedExecutor, VirtualClock
from batchinfer.sim.hardware import RooflineCostModel, preset
from batchinfer.sim.model_presets import model_preset
from batchinfer.sim.simulator import SimRequest, simulate, simulated_engine

from tests.sim.test_sim import ARCH, LinearCost, _drain, _prefill, _spans

PAPER_KNOBS = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                   frequency_penalty=0.2, presence_penalty=0.1)


class PrepCost(LinearCost):
    """LinearCost plus `prep` seconds of input preparation per stage and micro-batch."""

    def __init__(self, prep: float):
        self.prep = prep

    def input_prep_seconds(self, shape):
        return self.prep


def test_input_preparation_delays_every_forward_unless_token_safe():
    """prep 0.5 s. Serial: a's stage 0 [0.6, 4.6], stage 1 [5.35, 10.35]; b's stage 0
    [5.1, 7.1], stage 1 [10.85, 13.85]. Token-safe: a's plan reaches stage 1's idle worker at
    once, so its preparation is done long before its activations (stage 1 [4.85, 9.85]); b's
    plan reaches each worker only when a's micro-batch ends there (workers read their pipe
    between micro-batches): stage 0 [5.1, 7.1], stage 1 [10.35, 13.35]."""
    for token_safe, want_spans, want_done in (
            (False, [(0, 0, 0.6, 4.6), (0, 1, 5.35, 10.35), (1, 0, 5.1, 7.1), (1, 1, 10.85, 13.85)],
             [10.35, 13.85]),
            (True, [(0, 0, 0.6, 4.6), (0, 1, 4.85, 9.85), (1, 0, 5.1, 7.1), (1, 1, 10.35, 13.35)],
             [9.85, 13.35])):
        clock = VirtualClock()
        executor = SimulatedExecutor(clock, PrepCost(0.5), [2, 2], token_safe=token_safe)
        executor.submit(_prefill(4, "a"))
        executor.submit(_prefill(2, "b"))
        assert _spans(executor) == [pytest.approx(s) for s in want_spans], token_safe
        assert _drain(executor, clock) == pytest.approx(want_done), token_safe


def test_token_safe_preparation_waits_until_the_previous_forward_took_its_inputs():
    """Stages of 3 and 1 layers, prep 6 s; a and c 1 token, b 8. Stage 1 gets all three plans
    at 9.35 (when a ends there) and prepares b by 15.35, but c's preparation may only start
    when b's forward takes its inputs (25.85, CI == GI): ready at 31.85, so c runs [31.85,
    33.35] rather than from 30.85, when the stage is free."""
    clock = VirtualClock()
    executor = SimulatedExecutor(clock, PrepCost(6.0), [3, 1], token_safe=True)
    for name, tokens in (("a", 1), ("b", 8), ("c", 1)):
        executor.submit(_prefill(tokens, name))
    assert _spans(executor) == [pytest.approx(s) for s in [
        (0, 0, 6.1, 7.6), (0, 1, 7.85, 9.35), (1, 0, 13.6, 25.6), (1, 1, 25.85, 30.85),
        (2, 0, 25.6, 27.1), (2, 1, 31.85, 33.35)]]


def _decode_items(rows: int, history: int, knobs: dict) -> list[ScheduledSeq]:
    """`rows` decode items whose sequences reach `history` tokens with this step."""
    items = []
    for i in range(rows):
        seq = Sequence(Request(f"r{i}", [1] * (history - 1), SamplingParams(**knobs)))
        seq.output_token_ids.append(2)
        seq.num_computed_tokens = history - 1
        items.append(ScheduledSeq(seq, 1))
    return items


def _decode_shape(rows: int, history: int, knobs: dict) -> BatchShape:
    return BatchShape.of(MicroBatch(_decode_items(rows, history, knobs), phase="decode"))


def test_batch_shape_counts_the_sampling_knobs_and_the_block_tables():
    greedy = _decode_shape(4, 100, {"temperature": 0.0})
    assert (greedy.random_rows, greedy.penalty_tokens, greedy.max_seq_len) == (0, 0, 100)
    full = _decode_shape(4, 100, PAPER_KNOBS)
    assert (full.random_rows, full.penalty_tokens, full.max_seq_len) == (4, 400, 100)
    mixed = BatchShape.of(MicroBatch(_decode_items(1, 100, PAPER_KNOBS)
                                     + _decode_items(1, 300, PAPER_KNOBS), phase="decode"))
    assert (mixed.penalty_tokens, mixed.max_seq_len) == (2 * 300, 300)   # padded to the longest


def test_the_gpu_sampler_pays_its_host_work_per_penalty_token_and_cpu_samplers_split_rows():
    cost = RooflineCostModel(preset("h100"), model_preset("qwen2.5-72b"))
    greedy = cost.sample_seconds(_decode_shape(128, 500, {"temperature": 0.0}))
    short = cost.sample_seconds(_decode_shape(128, 500, PAPER_KNOBS))
    long = cost.sample_seconds(_decode_shape(128, 1500, PAPER_KNOBS))
    longer = cost.sample_seconds(_decode_shape(128, 2500, PAPER_KNOBS))
    assert 0 < greedy < short < long
    assert longer - long == pytest.approx(long - short)       # linear in the history
    assert cost.cpu_sample_seconds(128, 46) == pytest.approx(cost.cpu_sample_seconds(128) / 46)
    few, many = (cost.input_prep_seconds(_decode_shape(n, 1000, {})) for n in (16, 128))
    assert 0 < few < many


def test_a_measured_profile_keeps_input_preparation_inside_the_forward():
    from tests.sim.test_sim import _table
    from batchinfer.sim.cost_model import MeasuredCostModel

    assert MeasuredCostModel(_table()).input_prep_seconds(_decode_shape(8, 64, {})) == 0.0


def _sipipe_config(**switches) -> EngineConfig:
    params = strategy_class("sipipe").model_validate({"name": "sipipe", **switches})
    return EngineConfig(model={"max_model_len": 512}, cache={"kv_cache_memory": 1 << 20},
                        parallel={"pp": 2}, scheduler=params.scheduler_config(), strategy=params)


def test_sipipe_switches_reach_the_simulated_executor():
    executor = simulated_engine(_sipipe_config(sampler_threads=3), LinearCost(), ARCH, 512,
                                4).replicas[0].executor
    assert (executor.cpu_samplers, executor.sampler_threads, executor.split_samples,
            executor.token_safe, executor.structure_aware) == (2, 3, True, True, True)
    executor = simulated_engine(_sipipe_config(samplers=5), LinearCost(), ARCH, 512,
                                4).replicas[0].executor
    assert (executor.cpu_samplers, executor.split_samples) == (5, True)
    executor = simulated_engine(_sipipe_config(split_columns=False), LinearCost(), ARCH, 512,
                                4).replicas[0].executor
    assert (executor.cpu_samplers, executor.split_samples) == (2, False)
    executor = simulated_engine(_sipipe_config(cpu_sampling=False, token_safe_execution=False),
                                LinearCost(), ARCH, 512, 4).replicas[0].executor
    assert (executor.cpu_samplers, executor.token_safe) == (0, False)


class KnobRecorder(LinearCost):
    def __init__(self):
        self.shapes = []

    def stage_seconds(self, shape, layers, last, tp, threads, sample=True):
        self.shapes.append(shape)
        return super().stage_seconds(shape, layers, last, tp, threads, sample)


def test_simulated_requests_sample_with_the_given_knobs():
    config = EngineConfig(model={"max_model_len": 512}, cache={"kv_cache_memory": 1 << 20})
    for sampling, random_rows in ((None, 0), (PAPER_KNOBS, 1)):
        cost = KnobRecorder()
        simulate(config, [SimRequest(4, 3)], cost, ARCH, 512, 4, sampling=sampling)
        assert max(s.random_rows for s in cost.shapes) == random_rows
        assert max(s.penalty_tokens for s in cost.shapes) == (6 if sampling else 0)


def test_the_roofline_prices_a_mixture_of_experts_by_the_experts_it_runs_and_reads():
    """Qwen3-30B-A3B on an H100: a token runs its top 8 of 128 experts (FLOPs), and a step
    reads only the experts its tokens were routed to (bytes): one decode token reads 8 experts'
    weights, a long prefill reads them all; a dense model prices as before (all weights, every
    token), so the same layer with 128 dense-sized experts would cost E/k times the FLOPs."""
    arch = model_preset("qwen3-30b-a3b")
    cost = RooflineCostModel(preset("h100"), arch)
    expert = 3 * arch.hidden_size * arch.moe.intermediate_size * cost.dtype_bytes
    router = arch.hidden_size * arch.moe.num_experts * cost.dtype_bytes
    flops_1, bytes_1 = cost.ffn_work(1)
    assert bytes_1 == pytest.approx(8 * expert + router)
    assert flops_1 == pytest.approx(2 * (8 * expert + router) / cost.dtype_bytes)
    assert cost.ffn_work(4096)[1] == pytest.approx(128 * expert + router, rel=1e-6)
    assert cost.ffn_work(16)[1] < cost.ffn_work(64)[1] < 128 * expert + router
    assert cost.ffn_work(4096)[0] == pytest.approx(4096 * flops_1)

    def decode(seqs):
        return BatchShape(tokens=seqs, seqs=seqs, decode_seqs=seqs, decode_context=seqs * 512,
                          prefill_pairs=0, sample_rows=seqs)

    # decode is weight-read bound: 4 sequences read ~4x the expert bytes of one, far below all
    assert cost.layer_seconds(decode(4), 1) < 0.5 * cost.layer_seconds(decode(256), 1)
    dense = RooflineCostModel(preset("h100"), model_preset("qwen2.5-14b"))
    d = dense.arch
    assert dense.ffn_work(10) == (2 * 3 * d.hidden_size * d.intermediate_size * 10,
                                  3 * d.hidden_size * d.intermediate_size * dense.dtype_bytes)


def test_launching_ahead_hides_the_controller_under_the_step_before():
    """LinearCost: 0.1 s of controller work a step, decode steps of 2 layers x 0.5 s + 1 s of
    sampling = 2 s. Step by step every step pays the controller (2.1 s apart); launched ahead
    (async scheduling) only the first does: the next step was planned while this one ran."""
    for ahead, want in ((False, [2.1, 4.2, 6.3]), (True, [2.1, 4.1, 6.1])):
        clock = VirtualClock()
        executor = SimulatedExecutor(clock, LinearCost(), [2], launch_ahead=ahead)
        done = []
        for name in "abc":
            executor.submit(_prefill(1, name))
            done += _drain(executor, clock)
        assert done == [pytest.approx(t) for t in want], ahead


def test_the_simulated_engine_launches_ahead_where_the_real_one_would():
    """On a GPU's costs one process of the baseline launches ahead (the engine's default with
    CUDA), unless the recipe turns it off; on a CPU's it does not."""
    gpu = RooflineCostModel(preset("h100"), ARCH, 2)
    for config, cost, want in ((EngineConfig(), gpu, True),
                               (EngineConfig(scheduler={"async_scheduling": False}), gpu, False),
                               (EngineConfig(), LinearCost(), False)):
        engine = simulated_engine(config, cost, ARCH, 256, 2, 1)
        assert engine.replicas[0].executor.launch_ahead is want
