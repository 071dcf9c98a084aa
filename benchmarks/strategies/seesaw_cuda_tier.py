"""Seesaw's CPU KV tier on one GPU (issue 40, item 1). Needs a CUDA device.

    python benchmarks/strategies/seesaw_cuda_tier.py hidden --model DIR [--tokenizer DIR]
        the share of swap time hidden under compute, in Seesaw's two phases on the real engine
        (dummy weights, e.g. Llama-3.1-8B's shapes): prefill steps of --prompts prompts while
        the prefetcher moves as much KV as they wrote out to the shared CPU store, and decode
        steps of --decode-seqs sequences while it brings that KV back in, through its copy
        stream and pinned staging. Each timed alone and together: hidden = (compute + swaps -
        together) / swaps, medians of --repeats, overall = both phases' overlap / their swap
        time; with the async pipeline (the prefetcher thread) and without it (`async_pipeline:
        false`: the copies run inline, the paper's ablation)
    python benchmarks/strategies/seesaw_cuda_tier.py throughput --model DIR [--tokenizer DIR]
        a prefill-heavy job whose KV does not fit the device cache (--kv): the baseline engine,
        Seesaw on the one GPU with its CPU tier, and without it (`cpu_kv_tier: false`); output
        and total tokens per second as `vllm bench throughput` counts them

Prints one JSON object with the card and the host.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, timed_generate  # noqa: E402


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 30000, (length,), generator=gen).tolist() for _ in range(n)]


def _card(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu (a try of the script)"


def _model(args) -> dict:
    return {"path": str(args.model), "load_format": "dummy", "max_model_len": args.prompt + args.new,
            **({"tokenizer": str(args.tokenizer)} if args.tokenizer else {})}


def hidden(args) -> dict:
    import torch

    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import SamplingParams
    from batchinfer.resharding.kv_store import ShardView, allocate_store
    from batchinfer.resharding.prefetcher import Prefetcher

    engine = Engine.from_config(EngineConfig(
        model=_model(args), device={"device": args.device}, cache={"kv_cache_memory": "16GiB"},
        scheduler={"max_num_batched_tokens": args.step_tokens, "max_num_seqs": 256}))
    arch = engine.replicas[0].executor.model.arch
    dtype = getattr(torch, engine.info["dtype"])
    block = 16
    per_prompt = -(-args.prompt // block)
    blocks = args.prompts * per_prompt
    paged = torch.zeros(arch.num_layers, 2, blocks, arch.num_kv_heads, block, arch.head_dim,
                        dtype=dtype, device=args.device)
    store = allocate_store(blocks, arch.num_layers, arch.num_kv_heads, block, arch.head_dim, dtype)
    swap_bytes = paged.numel() * paged.element_size()              # each way
    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode = SamplingParams(max_tokens=args.decode_steps, temperature=0.0, ignore_eos=True)
    seeds = iter(range(1, 10_000))

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    # Seesaw's two phases: prefill writes prompts' KV that goes out to the store; decode runs
    # while stored sequences come back in (fresh prompts each time: no prefix reuse either way)
    phases = {
        "prefill_swap_out": ("out", lambda: (engine.generate(
            _prompts(args.prompts, args.prompt, next(seeds)), once), sync())),
        "decode_swap_in": ("in", lambda: (engine.generate(
            _prompts(args.decode_seqs, 32, next(seeds)), decode), sync())),
    }

    def submit(prefetcher, kind: str) -> None:
        for i in range(args.prompts):       # one transfer per prompt, as Seesaw's scheduler does
            ids = list(range(i * per_prompt, (i + 1) * per_prompt))
            prefetcher.submit(i, kind, ids, ids)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    for _, compute in phases.values():                    # warm-up: kernels, graphs
        compute()
    out = {"card": _card(args.device), "model": str(args.model),
           "prompts": args.prompts, "prompt_tokens": args.prompt, "step_tokens": args.step_tokens,
           "decode_seqs": args.decode_seqs, "decode_steps": args.decode_steps,
           "swap_GB_each_way": round(swap_bytes / 1e9, 2)}
    for label, threaded in (("async_pipeline", True), ("inline", False)):
        prefetcher = Prefetcher(store, lambda ids, seconds, thread: None, threaded=threaded)
        prefetcher.attach(paged, ShardView(0, arch.num_layers, 0, arch.num_kv_heads))
        for kind in ("out", "in"):                        # warm-up: staging allocated
            submit(prefetcher, kind)
            prefetcher.drain()
        row, swaps_total, overlap_total = {}, 0.0, 0.0
        for phase, (kind, compute) in phases.items():
            runs = []
            for _ in range(args.repeats):
                t_compute = timed(compute)
                t_swaps = timed(lambda: (submit(prefetcher, kind), prefetcher.drain()))
                t_both = timed(lambda: (submit(prefetcher, kind), compute(), prefetcher.drain()))
                runs.append((t_compute, t_swaps, t_both))
            t_compute, t_swaps, t_both = (statistics.median(col) for col in zip(*runs))
            overlap = t_compute + t_swaps - t_both
            swaps_total += t_swaps
            overlap_total += overlap
            row[phase] = {"compute_s": round(t_compute, 4), "swaps_s": round(t_swaps, 4),
                          "together_s": round(t_both, 4),
                          "hidden_share": round(overlap / t_swaps, 3),
                          "swap_GBps_alone": round(swap_bytes / t_swaps / 1e9, 2),
                          "runs": [[round(x, 4) for x in r] for r in runs]}
        prefetcher.close()
        out[label] = {"hidden_share": round(overlap_total / swaps_total, 3),
                      "pinned_staging": prefetcher.copier.pinned if prefetcher.copier else None,
                      **row}
    engine.close()
    return out


def throughput(args) -> dict:
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import SamplingParams
    from batchinfer.strategies.seesaw.params import SeesawParams

    prompts = _prompts(args.requests, args.prompt, 0)
    rows = [{"prompt": prompt, "max_tokens": args.new} for prompt in prompts]
    configs = {
        "baseline": {},
        "seesaw": {"strategy": SeesawParams(decode_tp=1, decode_pp=1,
                                            cpu_kv_cache_memory=args.store)},
        "seesaw-no-cpu-tier": {"strategy": SeesawParams(decode_tp=1, decode_pp=1,
                                                        cpu_kv_cache_memory=args.store,
                                                        cpu_kv_tier=False)},
    }
    out = {"card": _card(args.device), "model": str(args.model),
           "requests": args.requests, "prompt_tokens": args.prompt, "new_tokens": args.new,
           "device_kv": args.kv, "cpu_store": args.store}
    for name in args.only or configs:
        extra = configs[name]
        strategy = extra.get("strategy")
        config = EngineConfig(model=_model(args), device={"device": args.device},
                              cache={"kv_cache_memory": args.kv},
                              **({"scheduler": strategy.scheduler_config(), "strategy": strategy}
                                 if strategy else {}))
        with Engine.from_config(config) as engine:
            engine.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0))
            _, elapsed, n_in, n_out = timed_generate(engine, rows)
            stats = engine.stats()
        out[name] = {"elapsed_s": round(elapsed, 2), "output_tok_per_s": round(n_out / elapsed, 1),
                     "total_tok_per_s": round((n_in + n_out) / elapsed, 1),
                     "kv_capacity_tokens": stats["kv_capacity_tokens"],
                     **({"seesaw": stats["strategy_stats"]} if strategy else {})}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["hidden", "throughput"])
    ap.add_argument("--model", type=Path, required=True, help="a model directory (config.json is "
                    "enough: dummy weights)")
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a quick try of the script itself")
    ap.add_argument("--prompts", type=int, default=16, help="hidden: prompts per compute run")
    ap.add_argument("--prompt", type=int, default=2048, help="tokens per prompt")
    ap.add_argument("--step-tokens", type=int, default=16384, help="hidden: tokens per step")
    ap.add_argument("--decode-seqs", type=int, default=64, help="hidden: sequences decoding")
    ap.add_argument("--decode-steps", type=int, default=64, help="hidden: their new tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=192, help="throughput: requests")
    ap.add_argument("--new", type=int, default=32, help="throughput: output tokens per request")
    ap.add_argument("--kv", default="256MiB", help="throughput: the device KV cache")
    ap.add_argument("--store", default="4GiB", help="throughput: Seesaw's CPU store")
    ap.add_argument("--only", nargs="*", help="throughput: these configurations")
    args = ap.parse_args()
    emit(hidden(args) if args.what == "hidden" else throughput(args))


if __name__ == "__main__":
    main()
