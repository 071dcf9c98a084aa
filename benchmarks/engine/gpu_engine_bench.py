"""The engine on one GPU (issue 39's figures): the paged-attention kernel's bandwidth, the decode
step against its roofline, and ShareGPT throughput at real model sizes. Needs a CUDA device.

    python benchmarks/engine/gpu_engine_bench.py kernel
        decode attention, 256 sequences x 1,024-token contexts (Llama-3.1-8B's heads, and
        Qwen2.5-7B's), bf16, block 16: the Triton kernel and the portable torch path, each as
        bytes of K/V read per second against a device-to-device copy measured in the same run
    python benchmarks/engine/gpu_engine_bench.py roofline --model DIR
        256 sequences decoding together (dummy weights, bf16, 512-token prompts, 128 new tokens):
        each pure-decode step's time against its bound, (weights + the step's K/V) bytes over
        the copy bandwidth
    python benchmarks/engine/gpu_engine_bench.py sharegpt --model DIR --requests 1000 [--eager]
            [--no-async] [--moe-kernel torch]
        the first N requests of a ShareGPT V3 workload (each request's max_tokens its reference
        reply length, ignore_eos, greedy), as `vllm bench throughput` counts: output tokens and
        all tokens over the elapsed time; --eager: the torch attention path without CUDA graphs
        (the engine before the Triton kernel); the steps split into pure-decode and mixed ones,
        and the wall time outside the steps
    python benchmarks/engine/gpu_engine_bench.py swap --model DIR --requests 600 --kv 96MiB
        what preemption costs on the GPU (issue 43): the same requests in a KV cache too small
        for them, preempted sequences recomputed (the default) and then swapped to pinned host
        memory and back (`memory.preemption_mode: swap`), in one process: throughput, preemptions,
        the blocks copied and the seconds the copies took (timed around each plan's copies, the
        device synchronised), and whether both gave the same tokens
    python benchmarks/engine/gpu_engine_bench.py profile --model DIR --out TABLE.json
        `batchinfer profile`'s measured table for the model on this GPU (sim/profiler.py)
    python benchmarks/engine/gpu_engine_bench.py simulate --model DIR --table TABLE.json \
            --measured SHAREGPT.json
        runs on any machine: the same requests and batching as the measured `sharegpt` run,
        through the simulator on the table's costs, with the same KV capacity; sim / measured

Each prints one JSON object with the card's name.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, read_jsonl, sharegpt_path, timed_generate  # noqa: E402

HEADS = {"llama-3.1-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128)}


def _cuda_time(fn, repeats: int = 20) -> float:
    """Median seconds of fn() over `repeats` timed runs (CUDA events), after 3 warm-ups."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    seconds = _cuda_time(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / seconds


def kernel(args) -> dict:
    import torch

    from batchinfer.engine.attention import AttentionMetadata
    from batchinfer.engine.torch_attention import TorchAttention
    from batchinfer.engine.triton_attention import TritonAttention

    bandwidth = copy_bandwidth()
    out = {"card": _card(), "copy_bandwidth_GBps": round(bandwidth / 1e9, 1), "sequences": args.seqs,
           "context": args.context, "block_size": 16, "dtype": "bfloat16"}
    bs, n, ctx = 16, args.seqs, args.context
    blocks = n * -(-ctx // bs)
    for name, (heads, kv_heads, head_dim) in HEADS.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        kc = torch.randn(blocks + 1, kv_heads, bs, head_dim, device="cuda", generator=gen,
                         dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        order = torch.randperm(blocks, device="cuda", generator=gen) + 1
        tables = order.view(n, -1).tolist()
        q = torch.randn(n, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        kv_bytes = 2 * n * ctx * kv_heads * head_dim * 2
        row = {}
        for label, backend in (("triton", TritonAttention()), ("torch", TorchAttention())):
            meta = AttentionMetadata.build([1] * n, [ctx] * n, tables, bs, torch.device("cuda"))
            seconds = _cuda_time(lambda: backend.attend(q, kc, vc, meta, head_dim ** -0.5))
            row[label] = {"ms": round(seconds * 1e3, 4),
                          "kv_GBps": round(kv_bytes / seconds / 1e9, 1),
                          "share_of_copy_bandwidth": round(kv_bytes / seconds / bandwidth, 3)}
        out[name] = row
    return out


def _engine_config(args, eager: bool, max_num_seqs: int, max_model_len=None, device="cuda",
                   kv_bytes=None, cache=None):
    """Batching as vLLM's offline defaults on an H100 (1,024 sequences, 16,384 tokens a step),
    unless --max-num-seqs / --max-num-batched-tokens say otherwise."""
    from batchinfer.engine.config import EngineConfig

    simulated = device == "cpu"
    device = {"device": device}
    if eager:
        device.update(attention_backend="torch", cuda_graphs=False)
    if getattr(args, "moe_kernel", None):
        device["moe_kernel"] = args.moe_kernel
    model = {"path": str(args.model), "load_format": "dummy",
             **({"dtype": "bfloat16"} if simulated else {}),   # simulate: the GPU's auto
             **({"tokenizer": str(args.tokenizer)} if args.tokenizer else {}),
             **({"max_model_len": max_model_len} if max_model_len else {})}
    return EngineConfig(model=model, device=device,
                        cache={**({"kv_cache_memory": kv_bytes} if kv_bytes else {}),
                               **(cache or {})},
                        scheduler={"max_num_seqs": max_num_seqs,
                                   "max_num_batched_tokens": args.max_num_batched_tokens,
                                   "async_scheduling": False if args.no_async else None})


def _engine(args, eager: bool, max_num_seqs: int, max_model_len=None):
    import time

    from batchinfer.engine.engine import Engine

    start = time.perf_counter()
    engine = Engine.from_config(_engine_config(args, eager, max_num_seqs, max_model_len))
    info = engine.info
    print(f"engine built in {time.perf_counter() - start:.1f} s: "
          f"{info['attention_backend']} attention, moe_kernel {info.get('moe_kernel')}, "
          f"graphs {info['cuda_graphs']}, async {info['async_scheduling']}",
          file=sys.stderr, flush=True)
    return engine


def _card() -> str:
    import torch

    return torch.cuda.get_device_name()


def roofline(args) -> dict:
    import torch

    from batchinfer.engine.request import SamplingParams

    bandwidth = copy_bandwidth()
    engine = _engine(args, args.eager, args.seqs, max_model_len=4096)
    arch = engine.replicas[0].executor.model.arch
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 30000, (args.prompt,), generator=gen).tolist()
               for _ in range(args.seqs)]
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params)            # warm-up: kernels compiled, graphs captured
    engine.drain_step_events()
    engine.generate(prompts, params)
    events = engine.drain_step_events()
    decode = [e for e in events if e["num_prefill_tokens"] == 0 and e["num_decode_tokens"] == args.seqs]
    dtype_bytes = 2
    embed = arch.vocab_size * arch.hidden_size
    weight_bytes = (arch.num_params() - embed) * dtype_bytes
    kv_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype_bytes
    ratios, steps = [], []
    for j, e in enumerate(decode):
        context = args.prompt + j + 1
        bound = (weight_bytes + args.seqs * context * kv_token) / bandwidth
        ratios.append(bound / e["dur"])
        steps.append(e["dur"])
    return {"card": _card(), "model": str(args.model), "sequences": args.seqs,
            "prompt": args.prompt, "new_tokens": args.new, "eager": args.eager,
            "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
            "attention_backend": engine.info["attention_backend"],
            "cuda_graphs": engine.info["cuda_graphs"], "decode_steps": len(decode),
            "median_step_ms": round(statistics.median(steps) * 1e3, 3) if steps else None,
            "median_share_of_bound": round(statistics.median(ratios), 3) if ratios else None,
            "weight_GB": round(weight_bytes / 1e9, 2)}


def sharegpt(args) -> dict:
    from batchinfer.engine.request import SamplingParams

    rows = read_jsonl(sharegpt_path(args.workload))[:args.requests]
    engine = _engine(args, args.eager, args.max_num_seqs)
    engine.generate([r["prompt"] for r in rows[:8]], SamplingParams(max_tokens=4, temperature=0.0))
    engine.drain_step_events()
    outs, elapsed, n_in, n_out = timed_generate(engine, rows)
    events = engine.drain_step_events()
    if args.events:
        import jsonlines

        with jsonlines.open(args.events, "w") as out:
            out.write_all(events)
    graphs = engine.replicas[0].executor.graphs
    return {"card": _card(), "model": str(args.model), "requests": len(outs), "eager": args.eager,
            "attention_backend": engine.info["attention_backend"],
            "cuda_graphs": engine.info["cuda_graphs"], "max_num_seqs": args.max_num_seqs,
            "async_scheduling": engine.info["async_scheduling"],
            "moe_kernel": engine.info.get("moe_kernel"),
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_cache_GiB": round(engine.info["kv_cache_bytes"] / 2**30, 1),
            "kv_cache_bytes": engine.info["kv_cache_bytes"],
            "kv_capacity_tokens": engine.stats()["kv_capacity_tokens"],
            "step_split": step_split(events, elapsed),
            "elapsed_s": round(elapsed, 2), "output_tokens": n_out, "prompt_tokens": n_in,
            "output_tok_per_s": round(n_out / elapsed, 1),
            "total_tok_per_s": round((n_in + n_out) / elapsed, 1),
            "requests_per_s": round(len(outs) / elapsed, 2), "steps": len(events),
            **({"graph_steps": graphs.steps, "graph_capture_s": round(graphs.capture_seconds, 2)}
               if graphs else {})}


def swap(args) -> dict:
    """The same requests preempted by recomputing and by swapping, one fresh engine each."""
    import gc
    import time

    import torch

    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import SamplingParams

    rows = read_jsonl(sharegpt_path(args.workload))[:args.requests]
    out = {"card": _card() if args.device == "cuda" else "cpu", "model": str(args.model),
           "requests": len(rows), "kv_cache_memory": args.kv, "max_num_seqs": args.max_num_seqs,
           "max_model_len": args.max_model_len}
    tokens = {}
    for mode in ("recompute", "swap"):
        config = _engine_config(args, False, args.max_num_seqs, max_model_len=args.max_model_len,
                                device=args.device,
                                cache={"kv_cache_memory": args.kv, "preemption_mode": mode,
                                       "swap_space": args.swap_space})
        engine = Engine.from_config(config)
        executor = engine.replicas[0].executor
        copies = {"seconds": 0.0, "plans": 0, "blocks": 0}
        run = executor.swap_area.run

        def timed_run(ops, kv_caches, run=run, copies=copies):
            if not ops:
                return run(ops, kv_caches)
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            run(ops, kv_caches)
            if args.device == "cuda":
                torch.cuda.synchronize()
            copies["seconds"] += time.perf_counter() - start
            copies["plans"] += 1
            copies["blocks"] += len(ops)

        executor.swap_area.run = timed_run
        engine.generate([r["prompt"] for r in rows[:8]], SamplingParams(max_tokens=4, temperature=0.0))
        engine.drain_step_events()
        before = engine.stats()
        outs, elapsed, n_in, n_out = timed_generate(engine, rows)
        stats = engine.stats()
        out[mode] = {"elapsed_s": round(elapsed, 2), "output_tokens": n_out,
                     "prompt_tokens": n_in, "output_tok_per_s": round(n_out / elapsed, 1),
                     "preemptions": stats["num_preemptions"] - before["num_preemptions"],
                     "kv_capacity_tokens": stats["kv_capacity_tokens"],
                     "preemption_mode": engine.info.get("preemption_mode"),
                     **({"kv_swap": stats.get("kv_swap"), "blocks_copied": copies["blocks"],
                         "copy_seconds": round(copies["seconds"], 4),
                         "plans_with_copies": copies["plans"],
                         "copy_ms_per_block": round(1e3 * copies["seconds"] / copies["blocks"], 4)
                         if copies["blocks"] else None,
                         "copy_share_of_elapsed": round(copies["seconds"] / elapsed, 4)}
                        if mode == "swap" else {})}
        tokens[mode] = [o.output_token_ids for o in outs]
        del engine, executor, outs
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    out["swap_over_recompute"] = round(out["swap"]["output_tok_per_s"]
                                       / out["recompute"]["output_tok_per_s"], 3)
    out["same_tokens"] = round(sum(a == b for a, b in zip(tokens["recompute"], tokens["swap"]))
                               / max(len(rows), 1), 3)
    return out


def step_split(events: list[dict], elapsed: float) -> dict:
    """Where the wall time went: pure-decode and mixed (prefill) steps, each its count, time,
    forward and sampling seconds and mean sequences; and the time outside every step."""
    out = {}
    for kind, chosen in (("decode", [e for e in events if not e["num_prefill_tokens"]]),
                         ("mixed", [e for e in events if e["num_prefill_tokens"]])):
        out[kind] = {"steps": len(chosen), "seconds": round(sum(e["dur"] for e in chosen), 3),
                     "forward_s": round(sum(e["forward_s"] for e in chosen), 3),
                     "sample_s": round(sum(e["sample_s"] for e in chosen), 3),
                     "mean_seqs": round(statistics.mean(e["num_seqs"] for e in chosen), 1)
                     if chosen else None,
                     "prefill_tokens": sum(e["num_prefill_tokens"] for e in chosen)}
    out["outside_steps_s"] = round(elapsed - sum(e["dur"] for e in events), 3)
    return out


def profile(args) -> dict:
    from batchinfer.sim.profiler import profile_machine

    config = _engine_config(args, False, args.max_num_seqs)
    table = profile_machine(config, progress=lambda m, *_: print(m, file=sys.stderr, flush=True))
    table.save(args.out)
    return {"card": _card(), "model": str(args.model), "table": str(args.out),
            "profile_seconds": table.meta.get("seconds")}


def simulate(args) -> dict:
    """The measured run's requests and batching through the simulator on the table's costs."""
    import json

    from batchinfer.engine.runtime.build import model_setup
    from batchinfer.sim.cost_model import MeasuredCostModel
    from batchinfer.sim.profile_table import ProfileTable
    from batchinfer.sim.simulator import SimRequest, simulate_recipe_model

    text = args.measured.read_text()          # the run's printout: its JSON object after any log
    measured = json.JSONDecoder().raw_decode(text[text.index("{"):])[0]
    args.max_num_seqs = measured.get("max_num_seqs", args.max_num_seqs)
    args.max_num_batched_tokens = measured.get("max_num_batched_tokens",
                                               args.max_num_batched_tokens)
    config = _engine_config(args, False, args.max_num_seqs, device="cpu",
                            kv_bytes=measured["kv_cache_bytes"])
    table = ProfileTable.load(args.table)
    tokenizer = model_setup(config).tokenizer
    rows = read_jsonl(sharegpt_path(args.workload))[:measured["requests"]]
    requests = [SimRequest(len(tokenizer.encode(r["prompt"])), r["max_tokens"], r["max_tokens"])
                for r in rows]
    sim = simulate_recipe_model(config, requests, MeasuredCostModel(table), 1).to_json()
    return {"card": table.hardware.get("card") or measured["card"], "table": str(args.table),
            "requests": len(requests),
            "measured_output_tok_per_s": measured["output_tok_per_s"],
            "simulated_output_tok_per_s": round(sim["output_tok_per_s"], 1),
            "sim_over_measured": round(sim["output_tok_per_s"] / measured["output_tok_per_s"], 3),
            "measured_steps": measured["steps"], "simulated_steps": sim["steps"],
            "measured_elapsed_s": measured["elapsed_s"],
            "simulated_elapsed_s": round(sim["elapsed_s"], 2),
            "prompt_tokens": {"measured": measured["prompt_tokens"],
                              "simulated": sim["prompt_tokens"]},
            "kv_capacity_tokens": {"measured": measured.get("kv_capacity_tokens"),
                                   "simulated": sim["kv_capacity_tokens"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["kernel", "roofline", "sharegpt", "swap", "profile",
                                     "simulate"])
    ap.add_argument("--model", type=Path, help="a model directory (config.json is enough: dummy weights)")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="model.tokenizer (a config-only folder: default the embedded one's)")
    ap.add_argument("--workload", type=Path, default=None, help="ShareGPT JSONL with max_tokens")
    ap.add_argument("--requests", type=int, default=1000)
    # vLLM's V1 defaults for its offline LLM class on an H100 / H200 (engine arg_utils)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--eager", action="store_true",
                    help="the torch attention path without CUDA graphs")
    ap.add_argument("--no-async", action="store_true",
                    help="step by step: no scheduling ahead (scheduler.async_scheduling: false)")
    ap.add_argument("--moe-kernel", choices=["auto", "triton", "torch"], default=None,
                    help="device.moe_kernel (a mixture of experts' experts; default the engine's)")
    ap.add_argument("--out", type=Path, default=Path("profile_table.json"),
                    help="profile: where the table goes")
    ap.add_argument("--table", type=Path, help="simulate: a table from `profile`")
    ap.add_argument("--events", type=Path, help="sharegpt: every step's event, as JSONL")
    ap.add_argument("--measured", type=Path, help="simulate: a `sharegpt` run's JSON")
    ap.add_argument("--kv", default="96MiB", help="swap: memory.kv_cache_memory (small enough "
                    "that the requests preempt one another)")
    ap.add_argument("--swap-space", default="4GiB", help="swap: memory.swap_space")
    ap.add_argument("--max-model-len", type=int, default=2048,
                    help="swap: model.max_model_len (the cache must hold one such sequence)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="swap: where the engine runs (cpu: to try the script without a GPU)")
    args = ap.parse_args()
    emit({"kernel": kernel, "roofline": roofline, "sharegpt": sharegpt, "swap": swap,
          "profile": profile, "simulate": simulate}[args.what](args))


if __name__ == "__main__":
    main()
