"""SiPipe §5.1 on this CPU: sampling time per step, row-wise from scratch vs column-wise
incremental, with every sampling knob and all three penalties on.

A steady decode batch of B sequences (the paper's assumption: micro-batch n + p is micro-batch n),
V = 49,152 (SmolLM2's vocabulary), prompts of --prompt-len tokens and outputs that start at
--output-len tokens and grow by one per step. Per step, each method turns [B, V] logits into B
tokens:

- naive: vLLM's sampler: nothing kept across steps, so every sequence's prompt and output tokens
  are gathered into padded tensors from the Python lists, the [B, V] count and seen tensors built
  from scratch, the penalties applied, then the torch filters (engine/sampler.py's portable
  path, a fresh Sampler each step);
- default: this engine's row sampler on CPU (the padded tokens copied from the arrays it keeps
  per request, engine/token_history.py; penalties on the seen tokens only and the fused row
  kernel: kernels/sampling.cpp);
- column: SiPipe's column-wise replica (strategies/sipipe/column_sampler.py): logits arrive [V, B], the
  penalty buffers are updated with only the B new tokens, the column kernels run in place.
- pool S:T (--pool): SiPipe's sampler pool as the engine runs it (sampler_pool.py): S sampler
  processes of T torch threads, the micro-batch's columns split across them; this process is the
  controller (assigns the columns, sends each sampler its step, combines the shares) and the
  last stage (writes the logits into the shared slot: outside the timing), so a step is the
  controller's bookkeeping plus descriptor-to-last-share over real pipes. pool 1:1 is one
  sampler per micro-batch (`split_columns: false`); the pool's scaling is pool 1:1 over S:T,
  a ratio taken within each run.
The logits are fresh random numbers each step (a copy, outside the timing); the time of a step
is everything from logits to tokens, including the bookkeeping each method needs for the next
step. The methods take turns step by step (each step in a rotated order), so that a shared
host's load lands on all of them alike. Medians over --steps after 2 warm-up steps; with
--repeat, each figure is the median of the rounds (the rounds beside it), and each ratio the
median of the rounds' ratios. Every pool's tokens are checked against the column method's. host_costs.py times the column method the same way
(make_sequences and column_method, imported as benchmarks.strategies.sipipe_sampling_bench).

    python benchmarks/strategies/sipipe_sampling_bench.py [--batch 64 256] [--steps 15] [--threads 1]
        [--methods naive default column] [--pool 1:1 2:1 1:2 2:2] [--repeat 3]

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import SIPIPE_SAMPLING, emit  # noqa: E402

VOCAB = 49152        # SmolLM2's


def make_sequences(batch: int, prompt_len: int, output_len: int, rng: random.Random):
    """batch sequences with SiPipe's evaluation sampling (seeded per row), random prompts of
    prompt_len tokens and outputs of output_len so far."""
    from batchinfer.engine.request import Request, SamplingParams, Sequence

    seqs = []
    for i in range(batch):
        params = SamplingParams(seed=i, **SIPIPE_SAMPLING)
        seq = Sequence(request=Request(f"r{i}", [rng.randrange(VOCAB) for _ in range(prompt_len)],
                                       params))
        seq.output_token_ids = [rng.randrange(VOCAB) for _ in range(output_len)]
        seqs.append(seq)
    return seqs


class RowMethod:
    """This engine's row sampler (keep_state) or vLLM's (a fresh sampler every step)."""

    def __init__(self, seqs, native: bool, keep_state: bool):
        from batchinfer.engine.sampler import Sampler

        self.seqs, self.native, self.keep_state = seqs, native, keep_state
        self.sampler = Sampler(VOCAB, (0,), torch.device("cpu"), native_kernels=native)

    def step(self, logits: torch.Tensor) -> float:
        from batchinfer.engine.sampler import Sampler

        start = time.perf_counter()
        if not self.keep_state:               # nothing kept across steps (vLLM's)
            self.sampler = Sampler(VOCAB, (0,), torch.device("cpu"), native_kernels=self.native)
        tokens, _ = self.sampler.sample(logits, self.sampler.prepare(self.seqs))
        for seq, token in zip(self.seqs, tokens.tolist()):
            seq.output_token_ids.append(token)
        return time.perf_counter() - start

    def close(self) -> None:
        pass


def _join_from(seqs):
    """join_of for a ColumnAssigner: a sequence's column rebuilt from its prompt and output."""
    from batchinfer.strategies.sipipe.columns import ColumnJoin

    by_id = {s.request_id: s for s in seqs}

    def join_of(rid, col):                    # once per sequence (the first, warm-up step)
        seq = by_id[rid]
        return ColumnJoin(col, rid, seq.request.prompt_token_ids, list(seq.output_token_ids),
                          seq.request.sampling, seq.request.sampling.seed)

    return join_of


class ColumnMethod:
    """SiPipe's column-wise sampler in this process."""

    def __init__(self, seqs, native: bool, max_len: int):
        from batchinfer.strategies.sipipe.column_sampler import ColumnSampler
        from batchinfer.strategies.sipipe.columns import ColumnAssigner

        self.seqs = seqs
        self.sampler = ColumnSampler(VOCAB, len(seqs), max_len, (0,), native_kernels=native)
        self.assigner = ColumnAssigner(len(seqs))
        self.ids = [s.request_id for s in seqs]
        self.join_of = _join_from(seqs)

    def step(self, logits: torch.Tensor) -> float:
        logits_t = logits.t().contiguous()    # how the last stage delivers them
        start = time.perf_counter()
        _, update = self.assigner.assign(self.ids, [len(s.output_token_ids) for s in self.seqs],
                                         self.join_of)
        self.sampler.apply(update)
        tokens, _ = self.sampler.sample(logits_t)
        for seq, token in zip(self.seqs, tokens):
            seq.output_token_ids.append(token)
        return time.perf_counter() - start

    def close(self) -> None:
        pass


def column_method(seqs, native: bool, logits_steps, max_len: int) -> list[float]:
    """Seconds per step of SiPipe's column-wise sampler over logits_steps ([B, V] each)."""
    method = ColumnMethod(seqs, native, max_len)
    return [method.step(logits) for logits in logits_steps]


class PoolMethod:
    """A pool of `samplers` sampler processes of `threads` threads each, every micro-batch's
    columns split across them (one micro-batch in flight: PP degree 1). This process is the
    controller and the last stage."""

    def __init__(self, seqs, max_len: int, samplers: int, threads: int):
        import multiprocessing as mp

        from batchinfer.strategies.sipipe.logits_channel import allocate_slots
        from batchinfer.strategies.sipipe.sampler_pool import PoolLayout, ShareAssigner
        from batchinfer.strategies.sipipe.sampler_process import SamplerSpec, sampler_main

        self.seqs, self.batch = seqs, len(seqs)
        pool = PoolLayout.of(1, self.batch, True, samplers)
        self.slots, consumed = allocate_slots(pool, VOCAB, pool.slot_columns)
        ctx = mp.get_context("spawn")
        self.procs, self.controls, self.descriptors = [], [], []
        try:
            for index in range(samplers):
                control, child = ctx.Pipe(duplex=True)
                read_end, write_end = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=sampler_main, daemon=True, args=(SamplerSpec(
                    rank=index, replica=0, index=index, pool=pool, vocab_size=VOCAB,
                    max_model_len=max_len, eos_token_ids=(0,), threads=threads,
                    slots=self.slots, consumed=consumed, logits_conns=[read_end]), child))
                proc.start()
                child.close()
                read_end.close()
                self.procs.append(proc)
                self.controls.append(control)
                self.descriptors.append(write_end)
            for control in self.controls:
                _answer(control, "ready")
        except BaseException:
            self.close()
            raise
        self.assigner = ShareAssigner(samplers, pool.capacity)
        self.ids = [s.request_id for s in seqs]
        self.join_of = _join_from(seqs)
        self.mb_id = 0

    def step(self, logits: torch.Tensor) -> float:
        from batchinfer.strategies.sipipe.logits_channel import slot_view
        from batchinfer.strategies.sipipe.sampler_pool import SamplerStep

        start = time.perf_counter()
        cols, updates = self.assigner.assign(
            self.ids, [len(s.output_token_ids) for s in self.seqs], self.join_of)
        offset = 0
        for control, update in zip(self.controls, updates):
            control.send(("step", SamplerStep(self.mb_id, 0, update, offset, self.batch)))
            offset += update.width
        controller_s = time.perf_counter() - start
        slot_view(self.slots[0], VOCAB, self.batch)[:, cols] = logits.t()   # the last stage's
        start = time.perf_counter()
        for conn in self.descriptors:
            conn.send(("logits", self.mb_id, 0, 0.0))
        tokens = []
        for share in sorted((_answer(c, "result") for c in self.controls),
                            key=lambda m: m["offset"]):
            tokens += share["tokens"]
        for seq, col in zip(self.seqs, cols):
            seq.output_token_ids.append(tokens[col])
        self.mb_id += 1
        return controller_s + time.perf_counter() - start

    def close(self) -> None:
        for control in self.controls:
            try:
                control.send(("stop",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def _answer(conn, kind: str):
    message = conn.recv()
    if message[0] != kind:
        raise RuntimeError(f"sampler answered {message[0]!r} where {kind!r} was due: {message}")
    return message[2]


def _pool_config(text: str) -> tuple[int, int]:
    samplers, _, threads = text.partition(":")
    return int(samplers), int(threads or 1)


def _measure(args, native: bool, batch: int) -> dict:
    """One round at one batch size, the methods taking turns step by step: each method's
    median step (ms) and its sequences' final tokens."""
    gen = torch.Generator().manual_seed(batch)
    steps = args.steps + 2
    logits = [torch.randn(batch, VOCAB, generator=gen) * 3 for _ in range(steps)]
    max_len = args.output_len + steps + 1
    makers = {"naive": lambda s: RowMethod(s, False, keep_state=False),
              "default": lambda s: RowMethod(s, native, keep_state=True),
              "column": lambda s: ColumnMethod(s, native, max_len)}
    makers = {name: makers[name] for name in args.methods}
    for samplers, threads in args.pool:
        makers[f"pool_{samplers}x{threads}"] = (
            lambda s, n=samplers, t=threads: PoolMethod(s, max_len, n, t))
    methods, seqs = {}, {}
    try:
        for name, make in makers.items():
            seqs[name] = make_sequences(batch, args.prompt_len, args.output_len,
                                        random.Random(batch))
            methods[name] = make(seqs[name])
        times = {name: [] for name in methods}
        names = list(methods)
        for step, step_logits in enumerate(logits):
            turn = step % len(names)
            for name in names[turn:] + names[:turn]:
                times[name].append(methods[name].step(step_logits.clone()))
    finally:
        for method in methods.values():
            method.close()
    return {name: (round(statistics.median(times[name][2:]) * 1e3, 2),
                   [s.output_token_ids for s in seqs[name]]) for name in methods}


def main() -> None:
    from batchinfer.engine.kernels import load_native_kernels

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the in-process methods (a SiPipe sampler process "
                         "runs with sampler_threads, 1 by default)")
    ap.add_argument("--methods", nargs="*", default=["naive", "default", "column"],
                    choices=["naive", "default", "column"])
    ap.add_argument("--pool", nargs="*", type=_pool_config, default=[], metavar="S:T",
                    help="sampler pools to time: S processes of T threads each")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every method")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native = load_native_kernels()
    rounds = [{batch: _measure(args, native, batch) for batch in args.batch}
              for _ in range(args.repeat)]
    results = []
    for batch in args.batch:
        runs = [r[batch] for r in rounds]
        row = {"batch": batch, "vocab": VOCAB}
        for name in runs[0]:
            row[f"{name}_ms"] = statistics.median(run[name][0] for run in runs)
            if args.repeat > 1:
                row[f"{name}_runs_ms"] = [run[name][0] for run in runs]
        for over, base in (("naive", "column"), ("default", "column")):
            if over in runs[0] and base in runs[0]:
                row[f"{over}_over_{base}"] = _ratio(runs, over, base)
        for samplers, threads in args.pool:
            name = f"pool_{samplers}x{threads}"
            if "pool_1x1" in runs[0]:
                row[f"{name}_speedup_over_pool_1x1"] = _ratio(runs, "pool_1x1", name)
            if "column" in runs[0]:
                row[f"{name}_tokens_equal_column"] = all(
                    run[name][1] == run["column"][1] for run in runs)
        results.append(row)
    emit({"threads": args.threads, "native_kernels": native, "params": SIPIPE_SAMPLING,
          "prompt_len": args.prompt_len, "output_len": args.output_len,
          "steps": args.steps, "repeat": args.repeat, "results": results})


def _ratio(runs, numerator: str, denominator: str) -> float:
    """The median over rounds of numerator's time over denominator's, each from one round."""
    return round(statistics.median(run[numerator][0] / run[denominator][0] for run in runs), 2)


if __name__ == "__main__":
    main()
