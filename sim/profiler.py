"""Measures this machine for a recipe's model and writes a ProfileTable (sim/profile_table.py).

What is timed, all on the engine's own code paths:
- forward time of decode micro-batches (batch size x context length grid) and prefill
  micro-batches (token counts, and one token count at two prompt lengths for the attention
  term), through the in-process executor with synthetic sequences holding real KV blocks, at
  every thread count a rank may get (a PP=2 run on 2 cores gives each rank one);
- the LM head and the sampler for a range of sampled rows;
- the controller's own time per step (a short real job: each step's wall time less the executor's);
- point-to-point and all-reduce latency and bandwidth between two processes (gloo on CPU, NCCL on
  CUDA), each on its own threads, and copies between device and host memory;
- KV bytes per token and the memory available.
"""
from __future__ import annotations

import datetime
import logging
import platform
import statistics
import time
from typing import Callable, Optional

import numpy as np
import torch

from batchinfer.engine.build import available_memory, resolve_device
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.cpu_binding import compute_threads
from batchinfer.engine.engine import Engine
from batchinfer.engine.host_cpu import cpu_identity
from batchinfer.engine.request import Request, SamplingParams
from batchinfer.engine.scheduler import MicroBatch, ScheduledSeq
from batchinfer.engine.step_times import SyntheticSequences, interpolate

from .cost_model import ffn_share
from .link_profile import profile_links
from .profile_fit import fit_rank_compute
from .profile_table import LinkCost, ProfileTable

Progress = Callable[[str, int, int], None]     # (what now, steps done, steps in all)
log = logging.getLogger(__name__)
_warned_busy: set[tuple[int, ...]] = set()


def warn_if_host_busy() -> None:
    """A warning, once per process, when other processes keep some of this process's CPUs
    busy (engine/cpu_load.busy_cpus: the measurement `run` warns from, made once): the profile
    would record the slowdown as this machine's speed. Where some CPUs are free the engine
    also takes fewer threads (its own warning), and the table plans for those cores only."""
    from batchinfer.engine.cpu_binding import allowed_cpus
    from batchinfer.engine.cpu_load import busy_cpus, busy_text

    cpus = allowed_cpus()
    busy = busy_cpus(cpus)
    if not busy or tuple(cpus) in _warned_busy:
        return
    _warned_busy.add(tuple(cpus))
    named = busy_text(busy)
    log.warning("CPU(s) %s of the %d this profile may use are busy with other processes: the "
                "profile times this machine as it is now and records the slowdown as its "
                "speed; profile again when the host is idle (or plan with --table and a table "
                "measured on an idle host)", named, len(cpus))


class _Steps:
    """Counts the profile's steps for a progress bar."""

    def __init__(self, total: int, report: Progress):
        self.done, self.total, self.report = 0, total, report

    def __call__(self, message: str) -> None:
        self.report(message, self.done, self.total)
        self.done += 1

# dense enough that interpolating between knots stays within a few percent (GEMM speed is not
# linear in the row count between 16 and 64 rows on a CPU)
DECODE_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DECODE_CONTEXTS = (32, 512)
PREFILL_TOKENS = (16, 64, 256, 512, 1024, 2048)
PREFILL_PROMPT_LEN = 256
ATTENTION_PROBE = (1024, (64, 1024))      # the same tokens as short and as one long prompt
HEAD_ROWS = (1, 16, 64, 256)
PROFILE_KV_BYTES = 4 * 2**30          # every sequence of a probe gets its own blocks
# A GPU batches far more: decode up to vLLM's 1,024 sequences (CUDA graphs cover each size), and
# prefill steps up to its 16,384 tokens; its KV is sized as a run sizes it (engine/gpu_memory.py)
GPU_DECODE_BATCHES = DECODE_BATCHES + (384, 512, 768, 1024)
GPU_PREFILL_TOKENS = PREFILL_TOKENS + (4096, 8192, 16384)
GPU_ATTENTION_PROBE = (4096, (256, 4096))
GPU_HEAD_ROWS = HEAD_ROWS + (1024,)
DECODE_REPEATS = 5                    # decode probes are cheap: more repeats, less noise


class _Probe:
    """Synthetic micro-batches on replica 0's in-process executor, timed by its own clock."""

    def __init__(self, engine: Engine, repeats: int):
        self.engine = engine
        self.executor = engine.replicas[0].executor
        self.synth = SyntheticSequences(engine, int(engine.info["vocab_size"]))
        self.repeats = repeats
        self.gpu_head: Optional[tuple[list, list]] = None   # (LM head, sampler) by rows, on CUDA

    def forward_seconds(self, batch: MicroBatch, repeats: Optional[int] = None) -> float:
        """The executor's forward time. On a GPU its own clock sees only the host's part (the
        kernels run on after forward_s ends, and the sampler's read of the ids waits for them),
        so the whole step is timed there, GPU work included, less the LM head and sampler for
        its rows (measured first, `gpu_head`): what the fit calls the layers' time."""
        self.executor.execute(batch)                         # warm-up
        if self.executor.device.type != "cuda":
            return statistics.median(self.executor.execute(batch).forward_s
                                     for _ in range(repeats or self.repeats))
        times = []
        for _ in range(repeats or self.repeats):
            _sync(self.executor.device)
            t0 = time.perf_counter()
            self.executor.execute(batch)
            _sync(self.executor.device)
            times.append(time.perf_counter() - t0)
        rows = sum(1 for item in batch.items if item.samples)
        head = (interpolate(self.gpu_head[0], rows) + interpolate(self.gpu_head[1], rows)
                if rows and self.gpu_head else 0.0)
        return max(statistics.median(times) - head, 0.05 * statistics.median(times))

    def fits(self, size: int, tokens_each: int) -> bool:
        """Own blocks for every sequence: shared blocks would be read from cache, which no real
        batch gets (so no shared-block point enters the fit)."""
        return self.synth.fits(size, tokens_each)

    def warm_up(self) -> None:
        """A few micro-batches first, so the first timed point does not pay for cold caches,
        page faults and thread-pool start."""
        for _ in range(3):
            self.decode(8, 64)
            self.prefill([128])

    def scatter(self, num_seqs: int, tokens_each: int) -> None:
        """The probe's blocks in random order from a region a quarter larger than it needs, as
        a cache full of running sequences hands them out (contiguous blocks read ~30% faster)."""
        bm = self.synth.block_manager
        need = num_seqs * -(-tokens_each // bm.block_size)
        bm.scatter_free(need + need // 4, seed=need)

    def decode(self, size: int, context: int) -> Optional[dict]:
        if not self.fits(size, context + 1):
            return None
        self.scatter(size, context + 1)
        seqs = [self.synth.make(context, decode=True) for _ in range(size)]
        try:
            self.synth.allocate(seqs, context + 1)
            batch = MicroBatch([ScheduledSeq(s, 1) for s in seqs], phase="decode")
            return {"kind": "decode", "tokens": size, "seqs": size, "decode_seqs": size,
                    "decode_context": size * (context + 1), "prefill_pairs": 0.0,
                    "seconds": self.forward_seconds(batch, max(self.repeats, DECODE_REPEATS))}
        finally:
            self.synth.release()

    def prefill(self, lengths: list[int]) -> Optional[dict]:
        if not self.fits(len(lengths), max(lengths)):
            return None
        self.scatter(len(lengths), max(lengths))
        seqs = [self.synth.make(n, decode=False) for n in lengths]
        try:
            self.synth.allocate(seqs, max(lengths))
            batch = MicroBatch([ScheduledSeq(s, s.prompt_len) for s in seqs], phase="prefill")
            return {"kind": "prefill", "tokens": sum(lengths), "seqs": len(lengths),
                    "decode_seqs": 0, "decode_context": 0, "prefill_pairs": sum(n * (n + 1) / 2 for n in lengths),
                    "seconds": self.forward_seconds(batch)}
        finally:
            self.synth.release()

    def head(self, rows: int) -> tuple[float, float]:
        """(LM head seconds, sampler seconds) for `rows` sampled rows."""
        executor = self.executor
        model, sampler = executor.model, executor.sampler
        hidden = torch.randn(rows, model.arch.hidden_size, dtype=_activation_dtype(model),
                             device=executor.device)
        seqs = [self.synth.make(4, decode=True) for _ in range(rows)]
        try:
            with torch.inference_mode():
                model.compute_logits(hidden, None)
                head, sample = [], []
                for _ in range(self.repeats):
                    t0 = time.perf_counter()
                    logits = model.compute_logits(hidden, None)
                    _sync(executor.device)
                    t1 = time.perf_counter()
                    sampler.sample(logits, sampler.prepare(seqs))
                    _sync(executor.device)
                    head.append(t1 - t0)
                    sample.append(time.perf_counter() - t1)
        finally:
            self.synth.release()
        return statistics.median(head), statistics.median(sample)


def _activation_dtype(model) -> torch.dtype:
    """The dtype hidden states flow in: fp32 on a CPU even for a bf16 model (only its packed
    linears hold bf16 weights), so not the model's number format (model_record has that)."""
    return next(model.parameters()).dtype


def model_record(engine: Engine, config: EngineConfig) -> tuple[dict, int]:
    """(the table's `model` section, KV bytes per token) for the number formats the engine
    runs, as its info reports them (its resolved model.dtype and cache.kv_cache_dtype): a
    parameter's dtype says fp32 on a CPU running bf16 (activation dtype), which recorded twice
    the KV bytes a run has."""
    arch = engine.replicas[0].executor.model.arch
    dtype, kv_dtype = engine.info["dtype"], engine.info["kv_cache_dtype"]
    dtype_bytes = _element_bytes(dtype)
    kv_bytes = _element_bytes(kv_dtype)
    activations = _activation_dtype(engine.replicas[0].executor.model)
    record = {"model_id": engine.model_id, "num_layers": arch.num_layers,
              "hidden_size": arch.hidden_size, "vocab_size": arch.vocab_size,
              "dtype": dtype, "dtype_bytes": dtype_bytes,
              "kv_cache_dtype": kv_dtype, "kv_element_bytes": kv_bytes,
              # what crosses a link between ranks (MeasuredCostModel's transfers)
              "activation_dtype_bytes": activations.itemsize,
              "num_params": arch.num_params(), "ffn_share": round(ffn_share(arch), 6),
              "quantization": config.model.quantization,
              "quantize_lm_head": config.model.quantize_lm_head}
    return record, arch.kv_bytes_per_token(kv_bytes)


def _element_bytes(name: str) -> int:
    return getattr(torch, name).itemsize


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _round_down(value: int, step: int) -> int:
    return value // step * step


def _prefill_lengths(tokens: int, prompt_len: int) -> list[int]:
    lengths = [prompt_len] * (tokens // prompt_len)
    if tokens % prompt_len:
        lengths.append(tokens % prompt_len)
    return lengths


def measure_compute(engine: Engine, threads: int, repeats: int, decode_batches, decode_contexts,
                    prefill_tokens, attention_probe, head_rows, progress: Callable[[str], None]):
    """-> RankCompute at `threads` (the process's torch threads are set to it)."""
    if engine.replicas[0].executor.device.type == "cpu":
        torch.set_num_threads(threads)
    probe = _Probe(engine, repeats)
    head, sampling = [], []

    def measure_head() -> None:
        for rows in head_rows:
            progress(f"{threads} thread(s): LM head and sampler, {rows} rows")
            h, s = probe.head(rows)
            head.append((rows, h))
            sampling.append((rows, s))

    if engine.replicas[0].executor.device.type == "cuda":
        measure_head()                 # first: the forward probes' times are net of it
        probe.gpu_head = (head, sampling)
    probe.warm_up()
    points = []
    capacity = engine.replicas[0].scheduler.block_manager.capacity_tokens
    for size in decode_batches:
        longest = max(decode_contexts)
        for context in decode_contexts:
            if context == longest:       # the long context shrinks to what the cache holds
                context = min(context, _round_down(capacity // size - 16, 32))
            progress(f"{threads} thread(s): decode batch {size} at context {context}")
            if context < longest and context <= min(decode_contexts):
                continue
            point = probe.decode(size, context)
            if point is not None:
                points.append(point)
    shapes = [_prefill_lengths(n, min(n, PREFILL_PROMPT_LEN)) for n in prefill_tokens]
    if attention_probe:
        total, prompts = attention_probe
        shapes += [_prefill_lengths(total, p) for p in prompts]
    for lengths in shapes:
        progress(f"{threads} thread(s): prefill {sum(lengths)} tokens as {len(lengths)} prompt(s)")
        point = probe.prefill(lengths)
        if point is not None:
            points.append(point)
    if not head:
        measure_head()
    num_layers = engine.replicas[0].executor.model.arch.num_layers
    return fit_rank_compute(points, num_layers, head, sampling)


def measure_host_copy(device: torch.device, quick: bool = False) -> LinkCost:
    """Device <-> host copies (on CPU: memory to memory, one thread, as a rank's copy runs)."""
    from .link_profile import fit_link

    sizes = (1 << 20, 1 << 24) if quick else (1 << 20, 1 << 24, 1 << 27)
    points = []
    for nbytes in sizes:
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dst = torch.empty(nbytes // 4, dtype=torch.float32,
                          pin_memory=device.type == "cuda")
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            dst.copy_(src)
            _sync(device)
            times.append(time.perf_counter() - t0)
        points.append((nbytes, statistics.median(times[1:])))
    return LinkCost(**fit_link([p[0] for p in points], [p[1] for p in points]))


def measure_controller(engine: Engine, num_requests: int = 48, prompt_len: int = 24,
                       output_len: int = 24) -> tuple[float, float]:
    """(per step, per sequence) seconds the controller spends beside the executor: a short real
    job, each step's wall time less the executor's forward and sampling, fitted on batch size.
    The requests' lengths run evenly from 1 to 2 x `output_len` (the mean is about
    `output_len`), so the batch shrinks step by step from `num_requests` and the fit sees every
    size in between (equal lengths kept one batch size and a slope of 0)."""
    vocab = int(engine.info["vocab_size"])
    for i in range(num_requests):
        tokens = [1 + (i * 7 + j) % (vocab - 1) for j in range(prompt_len)]
        length = 1 + i * 2 * output_len // num_requests
        engine.add_request(Request(f"__controller-profile-{i}", tokens,
                                   SamplingParams(max_tokens=length, ignore_eos=True,
                                                  temperature=0.0)))
    seqs, overheads = [], []
    engine.drain_step_events()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        events = engine.drain_step_events()
        if len(events) == 1:
            ev = events[0]
            seqs.append(ev["num_seqs"])
            overheads.append(max(wall - ev["forward_s"] - ev["sample_s"], 0.0))
    if len(set(seqs)) < 2:
        return (statistics.median(overheads) if overheads else 0.0), 0.0
    slope, intercept = np.polyfit(np.asarray(seqs, float), np.asarray(overheads), 1)
    return max(float(intercept), 0.0), max(float(slope), 0.0)


def profile_machine(config: EngineConfig, threads: Optional[list[int]] = None, repeats: int = 3,
                    progress: Optional[Progress] = None, quick: bool = False) -> ProfileTable:
    """Profiles the recipe's model on this machine (minutes; `quick`: a few seconds, coarse).
    threads: per-rank thread counts to time (default: every divisor split of the cores)."""
    t_start = time.perf_counter()
    cores = compute_threads(config.device.num_threads)
    warn_if_host_busy()
    if threads is None:
        threads = sorted({max(1, cores // n) for n in range(1, cores + 1)})
    gpu = resolve_device(config.device.device).type == "cuda"
    # the recipe's KV element: the probes read the cache a run reads
    cache = {"block_size": config.cache.block_size,
             "kv_cache_dtype": config.cache.kv_cache_dtype}
    if not gpu:
        cache["kv_cache_memory"] = PROFILE_KV_BYTES
    # on a GPU the probes' largest steps are sized into the memory profile and graphs captured;
    # steps run one by one (no async scheduling), so a step's wall time less the executor's is
    # the controller's own work (under async scheduling it overlaps the GPU and the difference
    # means nothing: the tables once recorded 0 for it)
    scheduler = ({"max_num_seqs": GPU_DECODE_BATCHES[-1],
                  "max_num_batched_tokens": GPU_PREFILL_TOKENS[-1],
                  "async_scheduling": False} if gpu else {})
    probe_config = EngineConfig(model=config.model, device=config.device, cache=cache,
                                scheduler=scheduler)
    sets = dict(decode_batches=(1, 8) if quick else GPU_DECODE_BATCHES if gpu else DECODE_BATCHES,
                decode_contexts=(16, 64) if quick else DECODE_CONTEXTS,
                prefill_tokens=(16, 64) if quick else GPU_PREFILL_TOKENS if gpu else PREFILL_TOKENS,
                attention_probe=(64, (16, 64)) if quick else GPU_ATTENTION_PROBE if gpu
                else ATTENTION_PROBE,
                head_rows=(1, 8) if quick else GPU_HEAD_ROWS if gpu else HEAD_ROWS)
    per_threads = (len(sets["decode_batches"]) * len(sets["decode_contexts"])
                   + len(sets["prefill_tokens"]) + len(sets["attention_probe"][1])
                   + len(sets["head_rows"]))
    progress = _Steps(4 + per_threads * len(threads), progress or (lambda *args: None))
    progress("loading the model")
    with Engine.from_config(probe_config) as engine:
        executor = engine.replicas[0].executor
        device = executor.device
        if device.type != "cpu":
            progress.total -= per_threads * (len(threads) - 1)
            threads = [1]
        compute = {}
        for t in threads:
            compute[t] = measure_compute(engine, t, 1 if quick else repeats, progress=progress,
                                         **sets)
        if device.type == "cpu":
            torch.set_num_threads(1)
        progress("copies between device and host memory")
        host_copy = measure_host_copy(device, quick)
        if device.type == "cpu":
            torch.set_num_threads(cores)
        progress("controller overhead: a short job")
        # a GPU runs hundreds of sequences a step: the fit spans 1 to 256 of them
        per_step, per_seq = measure_controller(engine, 8 if quick else 256 if gpu else 48)
        arch = executor.model.arch
        model_info, kv_per_token = model_record(engine, config)
        dtype_bytes = model_info["dtype_bytes"]
        # what a run has for weights + KV: on a GPU the probe engine sized its KV as a run does
        # (after weights and the largest step's activations), and the free memory now is the rest
        memory = (available_memory(device) if device.type == "cpu"
                  else int(engine.info["kv_cache_bytes"]) + arch.num_params() * dtype_bytes)
    progress("point-to-point and all-reduce between two processes")
    links = profile_links(device.type, quick=quick, tp_all_reduce=config.parallel.tp_all_reduce)
    hardware = {"device": device.type, "cores": cores, "machine": platform.machine(),
                **({"card": torch.cuda.get_device_name(device),
                    "gpus": torch.cuda.device_count()} if device.type == "cuda" else {}),
                "processor": platform.processor() or platform.machine(),
                **({"cpu_model": cpu_identity()[0]} if cpu_identity()[0] else {}),
                "torch": torch.__version__,
                "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds")}
    return ProfileTable(model_info, hardware, compute, LinkCost(**links["p2p"]),
                        LinkCost(**links["allreduce"]), per_step, per_seq, kv_per_token,
                        memory,
                        {"seconds": round(time.perf_counter() - t_start, 1), "quick": quick,
                         "repeats": repeats, "link_backend": links["backend"],
                         "link_points": links["points"]}, host_copy)
