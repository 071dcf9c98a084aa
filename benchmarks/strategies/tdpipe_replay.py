"""TD-Pipe's scheduler replayed on a workload's real lengths, without a model: the decisions it
takes (micro-batches, preemptions, recomputed prefill tokens, phase switches and why, most
micro-batches in flight), exactly as the engine would take them, in seconds and free of the
machine's timing noise. Used to see why one workload's lead differs from another's (issue 41:
held-out ShareGPT requests); the intensity comparison reads a step-time table (--step-times, as
report.json's engine.step_times; default: one profiled on a 2-core Xeon, PP=2, SmolLM2-135M).

    python benchmarks/strategies/tdpipe_replay.py --requests 400 --offset 1000 --output-scale 0.25
    python benchmarks/strategies/tdpipe_replay.py --requests 80 --stop-at-eos --max-tokens 512
    python benchmarks/strategies/tdpipe_replay.py --requests 120 --stop-at-eos --max-tokens 1024 \
        --step-times TABLE --prefill-length-cost 6.5e-4
    python benchmarks/strategies/tdpipe_replay.py --requests 120 --stop-at-eos --max-tokens 1024 \
        --preemption-mode swap --kv-dtype bfloat16      # memory.preemption_mode: swap

With the run's own step table the replay takes the engine's decisions exactly (performance.md
2026-11-29 evening); `--prefill-length-cost` also charges a long sequence's prefill (a
preempted request's recompute) by its length, which the table, profiled on 256-token prompts,
does not see.

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import embedded_source, emit  # noqa: E402
from benchmarks.strategies import eos_workload  # noqa: E402
from benchmarks.strategies.strategy_bench import workload_rows  # noqa: E402

# profiled at startup by tdpipe_bench.py on an Intel Xeon @ 2.50GHz, 2 cores, PP=2 (2026-11-27)
DEFAULT_STEP_TIMES = {"decode": [[1, 0.0309], [8, 0.0403], [32, 0.0716], [64, 0.1191],
                                 [128, 0.2262], [256, 0.5047]],
                      "prefill": [[256, 0.3823], [1024, 1.7303]]}
CONFIGS = {"tdpipe": {}, "tdpipe-literal-forecast": {"count_ending_requests": False},
           "tdpipe-no-prefill-ahead": {"launch_prefills_ahead": False}}


def prefill_weight(batch, length_cost: float, profiled_len: int) -> float:
    """How much more a prefill micro-batch costs than the table's prefill_time(tokens) says, the
    table being profiled on `profiled_len`-token prompts: each chunk's tokens cost 1 +
    length_cost x (twice their mean position - profiled_len) times a profiled token (attention
    grows with the position; benchmarks/engine/prefill_shape.py measures length_cost)."""
    if not length_cost:
        return 1.0
    total = weighted = 0
    for item in batch.items:
        start = item.seq.num_computed_tokens
        total += item.num_tokens
        weighted += item.num_tokens * (1 + length_cost * (2 * start + item.num_tokens
                                                          - profiled_len))
    return weighted / max(total, 1)


class PipelineClock:
    """When each micro-batch comes back from a pipeline of `depth` equal stages (a batch's step
    time split evenly over them; a stage runs one batch at a time, in launch order), the
    controller launching at the time the last batch returned. Unlike the summed step times this
    sees the bubbles: a stage idle while the controller waits on a returning batch (a decode
    phase with fewer than `depth` batches, the drain around a phase switch)."""

    def __init__(self, depth: int):
        self.depth = max(depth, 1)
        self.free = [0.0] * self.depth      # when each stage finishes its last batch
        self.now = 0.0                      # the controller's time

    def launch(self, seconds: float) -> float:
        """-> when a batch launched now returns from the last stage."""
        ready = self.now
        for stage in range(self.depth):
            ready = max(ready, self.free[stage]) + seconds / self.depth
            self.free[stage] = ready
        return ready

    def returned(self, at: float) -> None:
        self.now = max(self.now, at)


def replay(params: dict, prompts: list[int], lengths: list[int], limits: list[int],
           predicted: list, kv_tokens: int, step_times, depth: int = 2,
           on_finished=None, prefill_length_cost: float = 0.0,
           prefix_caching: bool = False, swap_blocks: int = 0,
           swap_block_seconds: float = 0.0) -> dict:
    """`predicted`: per request a length, None, or a Forecast (point, upper, confidence).
    `on_finished(sched, seqs)`: called with the sequences each returned micro-batch finished
    (an online predictor learns there). `modelled_s`: the micro-batches' step times from the
    table summed, over `depth` stages (a throughput proxy free of the machine's noise), a
    prefill's weighted by its sequences' lengths when `prefill_length_cost` (prefill_weight);
    `pipeline_s`: the same step times run through a PipelineClock (bubbles counted).
    `prefix_caching`: the block manager indexes full blocks, so a preempted request's recompute
    starts from whatever of its blocks is still cached when it is admitted again.
    `swap_blocks` (memory.preemption_mode swap): a swap area of that many blocks, so a preempted
    request's KV is copied out and back instead of recomputed; each micro-batch carries the copies
    decided since the one before, `swap_block_seconds` a block over the whole pipeline, paid as
    the engine pays them, each stage its share before the batch's forward (sim/executor.py).
    0: recompute, the paper's choice."""
    from batchinfer.engine.kv_cache import BlockManager
    from batchinfer.engine.kv_swap import attach_swap_space, swap_unsupported_reason
    from batchinfer.engine.request import SequenceStatus
    from batchinfer.strategies.tdpipe.scheduler import TDPipeParams, TDPipeScheduler
    from batchinfer.sim.scheduler_driver import launch, make_seq

    blocks = BlockManager(kv_tokens // 16, 16, prefix_caching=prefix_caching)
    sched = TDPipeScheduler(blocks, TDPipeParams(
        max_num_seqs=512, max_num_batched_tokens=2048, **params), 2048, depth=depth)
    sched.step_times = step_times
    if swap_blocks and not attach_swap_space(blocks, sched, swap_blocks):
        raise ValueError(f"the replay cannot swap: {swap_unsupported_reason(blocks, sched)}")
    for i, (n, limit, guess) in enumerate(zip(prompts, limits, predicted)):
        point = getattr(guess, "point", guess)
        seq = make_seq(i, n, limit, predicted=point)
        if prefix_caching:      # every prompt its own tokens: no two share a block
            seq.request.prompt_token_ids = [1_000 + i] * n
        seq.request.predicted_output_upper = getattr(guess, "upper", None)
        seq.request.predicted_confidence = getattr(guess, "confidence", None)
        sched.add(seq)
    true_len = {f"r{i}": n for i, n in enumerate(lengths)}
    profiled_len = int(step_times.meta.get("prompt_len", 256))
    in_flight, launched, most, copied = collections.deque(), [], 0, 0
    clock = PipelineClock(depth)
    while sched.has_unfinished() or in_flight:
        while len(in_flight) < sched.in_flight_limit(depth):
            batches = launch(sched)
            if not batches:
                break
            for b in batches:
                if b.phase == "prefill":
                    size = b.num_tokens
                    seconds = step_times.prefill_time(size) * prefill_weight(
                        b, prefill_length_cost, profiled_len)
                else:
                    size = len(b)
                    seconds = step_times.decode_time(size)
                if blocks.swap is not None:     # the copies ride on this micro-batch
                    ops = len(blocks.swap.take_ops())
                    copied += ops
                    seconds += ops * swap_block_seconds
                in_flight.append((b, clock.launch(seconds)))
                launched.append((b.phase, size, seconds))
            most = max(most, len(in_flight))
        if not in_flight:       # nothing to wait on and nothing launchable: a stall
            left = sched.num_waiting + sched.num_running + sched.num_swapped
            raise RuntimeError(f"the replay stalled with {left} requests unfinished and nothing "
                               "it could launch (a prompt longer than the KV cache holds?)")
        batch, returns_at = in_flight.popleft()
        clock.returned(returns_at)
        done = []
        for item in batch.items:           # what the engine does with a returned micro-batch
            seq = item.seq
            seq.in_flight = False
            seq.num_computed_tokens += item.num_tokens
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(7)
                if len(seq.output_token_ids) >= true_len[seq.request.request_id]:
                    seq.status = SequenceStatus.FINISHED
                    done.append(seq)
        sched.on_result(batch)
        if on_finished is not None and done:
            on_finished(sched, done)
    reasons = collections.Counter(d["reason"] for d in sched.drain_decisions())
    decode = [n for phase, n, _ in launched if phase == "decode"]
    modelled = sum(seconds for _, _, seconds in launched) / max(depth, 1)
    prefill_tokens = sum(n for phase, n, _ in launched if phase == "prefill")
    return {"modelled_s": round(modelled, 2), "pipeline_s": round(clock.now, 2),
            "micro_batches": len(launched), "preemptions": sched.num_preemptions,
            "phase_switches": sched.num_switches,
            "mean_decode_batch": round(sum(decode) / max(len(decode), 1), 1),
            "prefill_tokens": prefill_tokens,
            "recomputed_prefill_tokens": prefill_tokens - sum(prompts),
            "most_in_flight": most, "switch_reasons": dict(reasons),
            **({"kv_swap": {**blocks.swap.summary(), "copied_blocks": copied}}
               if blocks.swap is not None else {})}


def add_swap_arguments(ap: argparse.ArgumentParser) -> None:
    """The replay's swap options (replay_swap_kwargs reads them)."""
    ap.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute",
                    help="TD-Pipe replay: memory.preemption_mode (swap: a swap area of --swap-gib)")
    ap.add_argument("--swap-gib", type=float, default=4.0, help="memory.swap_space (its default)")
    ap.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the run's KV cache element: a swapped block's bytes")
    ap.add_argument("--swap-gbps", type=float, default=None, help="host copy bandwidth for the "
                    "swaps (default: measured here as the profiler does, one thread)")


def replay_swap_kwargs(args, block_size: int = 16) -> dict:
    """replay()'s swap_blocks and swap_block_seconds for --preemption-mode: a block is the
    embedded model's K and V over every layer (benchmarks.common.kv_bytes_per_token), copied at
    --swap-gbps or at the host copy cost `batchinfer profile` measures (one thread, as a rank's
    copy runs: sim/profiler.measure_host_copy)."""
    if args.preemption_mode != "swap":
        return {}
    from benchmarks.common import kv_bytes_per_token

    block_bytes = kv_bytes_per_token(embedded_source().arch, args.kv_dtype) * block_size
    if args.swap_gbps:
        seconds = block_bytes / (args.swap_gbps * 1e9)
    else:
        import torch

        from batchinfer.sim.profiler import measure_host_copy

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            seconds = measure_host_copy(torch.device("cpu"), quick=True).seconds(block_bytes)
        finally:
            torch.set_num_threads(threads)
    return {"swap_blocks": int(args.swap_gib * (1 << 30)) // block_bytes,
            "swap_block_seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--output-scale", type=float, default=0.25)
    ap.add_argument("--kv-tokens", type=int, default=14448,
                    help="KV tokens per pipeline (tdpipe_bench's 16,384 split 17 + 13)")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="eos_workload.py's lengths (its cached reference pass must exist)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--reference-kv-tokens", type=int, default=16384,
                    help="the --kv-tokens tdpipe_bench.py's reference pass ran with (its default)")
    ap.add_argument("--predictor", choices=["oracle", "mean", "bert", "none"], default="oracle")
    ap.add_argument("--step-times", type=Path, default=None)
    ap.add_argument("--prefill-length-cost", type=float, default=0.0,
                    help="a prefill token's extra cost per token of position (prefill_weight)")
    add_swap_arguments(ap)
    args = ap.parse_args()
    from batchinfer.engine.step_times import StepTimes

    table = (StepTimes.load(args.step_times) if args.step_times
             else StepTimes.from_json(DEFAULT_STEP_TIMES))
    rows = workload_rows(args.requests, args.output_scale, "sharegpt", args.offset,
                         args.max_tokens if args.stop_at_eos else None)
    tokenizer = embedded_source().tokenizer
    prompts = [len(eos_workload.prompt_ids(tokenizer, r["prompt"], args.stop_at_eos))
               for r in rows]
    lengths = None
    if args.stop_at_eos:
        path = eos_workload.reference_path(args.requests, args.offset, args.max_tokens,
                                           args.reference_kv_tokens)
        lengths = json.loads(path.read_text())
        true = [lengths[r["id"]] for r in rows]
    else:
        true = [r["max_tokens"] for r in rows]
    predicted, _ = eos_workload.forecasts(args.predictor, rows, lengths)
    limits = [r["max_tokens"] for r in rows]
    swap = replay_swap_kwargs(args)
    results = {name: replay(params, prompts, true, limits, predicted, args.kv_tokens, table,
                            prefill_length_cost=args.prefill_length_cost, **swap)
               for name, params in CONFIGS.items()}
    emit({"requests": args.requests, "offset": args.offset, "output_scale": args.output_scale,
          "stop_at_eos": args.stop_at_eos, "predictor": args.predictor,
          "kv_tokens": args.kv_tokens, "prompt_tokens": sum(prompts), "output_tokens": sum(true),
          "step_times": "default" if args.step_times is None else str(args.step_times),
          "preemption_mode": args.preemption_mode,
          **({"swap_block_ms": round(swap["swap_block_seconds"] * 1e3, 4),
              "swap_blocks": swap["swap_blocks"]} if swap else {}),
          "results": results})


if __name__ == "__main__":
    main()
