"""benchmarks/strategies/tdpipe_replay.py: its pipeline clock, and a replay that takes the
scheduler's decisions on given lengths."""
from __future__ import annotations

import pytest

from batchinfer.engine.step_times import StepTimes
from benchmarks.strategies.tdpipe_replay import DEFAULT_STEP_TIMES, PipelineClock, replay


def test_a_full_pipeline_returns_a_batch_per_stage_time():
    clock = PipelineClock(depth=2)
    first, second = clock.launch(1.0), clock.launch(1.0)      # 0.5 s on each stage
    assert (first, second) == (pytest.approx(1.0), pytest.approx(1.5))
    clock.returned(first)
    assert clock.launch(1.0) == pytest.approx(2.0)             # no stage waited
    assert clock.free == [pytest.approx(1.5), pytest.approx(2.0)]


def test_one_batch_in_flight_leaves_a_stage_idle_half_the_time():
    clock = PipelineClock(depth=2)
    done = 0.0
    for _ in range(4):
        done = clock.launch(1.0)
        clock.returned(done)
    assert done == pytest.approx(4.0)     # the summed step times over the stages say 2.0


@pytest.mark.parametrize("within", [True, False])
def test_the_replay_counts_the_bubbles_the_summed_times_miss(within):
    table = StepTimes.from_json(DEFAULT_STEP_TIMES)
    prompts, lengths = [200] * 24, [100, 300] * 12
    out = replay({"admit_within_capacity": within}, prompts, lengths, [512] * 24, lengths,
                 kv_tokens=4096, step_times=table)
    assert out["pipeline_s"] >= out["modelled_s"] > 0
    assert out["prefill_tokens"] >= sum(prompts)
    # exact forecasts: held within the capacity nothing is preempted
    assert (out["preemptions"] == 0) if within else (out["preemptions"] > 0), out


def test_the_reference_lengths_are_cached_per_kv_budget_and_host_build(monkeypatch):
    """A bf16 reference pass preempts (and re-prefills) by its KV budget, and its replies depend
    on the kernels and on what dtype auto resolves to: each gets its own cache entry."""
    import batchinfer.engine.kernels as kernels
    from benchmarks.strategies.eos_workload import reference_path

    monkeypatch.setattr(kernels, "loaded_kernel_builds", lambda: ("model_aaaa", "exact_bbbb"))
    monkeypatch.delenv("BATCHINFER_CPU_AUTO_DTYPE", raising=False)
    base = reference_path(120, 360, 1024, 16384)
    assert base == reference_path(120, 360, 1024, 16384)
    assert base.name.startswith("sharegpt-eos-lengths-n120-off360-max1024-")
    assert reference_path(120, 360, 1024, 8192) != base
    monkeypatch.setenv("BATCHINFER_CPU_AUTO_DTYPE", "float32")
    forced = reference_path(120, 360, 1024, 16384)
    assert forced != base
    monkeypatch.setenv("BATCHINFER_CPU_AUTO_DTYPE", " Float32 ")   # read as the engine reads it
    assert reference_path(120, 360, 1024, 16384) == forced
    monkeypatch.delenv("BATCHINFER_CPU_AUTO_DTYPE")
    monkeypatch.setattr(kernels, "loaded_kernel_builds", lambda: ("model_cccc", "exact_bbbb"))
    assert reference_path(120, 360, 1024, 16384) != base


def test_the_replay_swaps_instead_of_recomputing_and_prices_the_copies():
    """memory.preemption_mode swap in the replay: the preempted requests' KV goes out and comes
    back (nothing prefilled twice), and each copied block costs what it is told, on the batch
    that carries it."""
    table = StepTimes.from_json(DEFAULT_STEP_TIMES)
    prompts, lengths = [200] * 24, [100, 300] * 12
    args = ({"admit_within_capacity": False}, prompts, lengths, [512] * 24, lengths)
    recompute = replay(*args, kv_tokens=4096, step_times=table)
    free = replay(*args, kv_tokens=4096, step_times=table, swap_blocks=1024)
    priced = replay(*args, kv_tokens=4096, step_times=table, swap_blocks=1024,
                    swap_block_seconds=0.01)
    assert recompute["recomputed_prefill_tokens"] > 0 and "kv_swap" not in recompute
    swap = free["kv_swap"]
    assert free["preemptions"] > 0 and free["recomputed_prefill_tokens"] == 0, free
    assert swap["swap_outs"] == free["preemptions"] and swap["swap_ins"] == swap["swap_outs"]
    assert swap["copied_blocks"] > 0
    # the same decisions, the copies' time on top
    assert priced["kv_swap"] == swap and priced["micro_batches"] == free["micro_batches"]
    copies_s = swap["copied_blocks"] * 0.01
    assert priced["modelled_s"] == pytest.approx(free["modelled_s"] + copies_s / 2, abs=0.02)
    assert priced["pipeline_s"] > free["pipeline_s"]


def test_the_replays_swap_area_is_the_embedded_models_blocks():
    """--preemption-mode swap: a 16-token block of SmolLM2-135M's K and V (30 layers, 3 KV heads
    of 64) is 368,640 bytes in bf16, so 4 GiB hold 11,650; --swap-gbps prices each."""
    import argparse

    from benchmarks.strategies.tdpipe_replay import add_swap_arguments, replay_swap_kwargs

    ap = argparse.ArgumentParser()
    add_swap_arguments(ap)
    assert replay_swap_kwargs(ap.parse_args([])) == {}
    kwargs = replay_swap_kwargs(ap.parse_args(["--preemption-mode", "swap", "--kv-dtype",
                                               "bfloat16", "--swap-gbps", "10"]))
    assert kwargs["swap_blocks"] == (4 << 30) // 368_640 == 11_650
    assert kwargs["swap_block_seconds"] == pytest.approx(368_640 / 10e9)
    fp32 = replay_swap_kwargs(ap.parse_args(["--preemption-mode", "swap", "--swap-gbps", "10"]))
    assert fp32["swap_blocks"] == (4 << 30) // 737_280


def test_a_replay_that_cannot_go_on_says_so():
    """A prompt the KV cache cannot hold never runs: the replay stops with an error instead of
    reporting the others' time as the job's."""
    table = StepTimes.from_json(DEFAULT_STEP_TIMES)
    with pytest.raises(RuntimeError, match="stalled"):
        replay({}, [64, 8000], [8, 8], [64, 64], [8, 8], kv_tokens=1024, step_times=table)
