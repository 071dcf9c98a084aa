"""What LoRA adapters cost a decode-heavy batch (engine/model/lora.py), in one process:
SmolLM2-135M (the embedded default) fp32, greedy, `--requests` prompts of 24.. token ids and
`--tokens` output tokens each, four configurations alternated over `--repeats`:
- plain: no model.lora_modules;
- loaded_base: two rank-16 adapters on all seven linears loaded, every request on the base model
  (the steps carry no adapter slot: what a job that loads adapters pays where none is used);
- loaded_mixed: requests cycle base / adapter 1 / adapter 2 (every step mixes three groups);
- loaded_one: every request on adapter 1 (one group: the delta over all rows, no gather).
The adapters are made by peft (the `test` extra) from the model, seeded, in a temporary folder.

    python benchmarks/engine/lora_bench.py --repeats 3

Prints one JSON object: seconds per run of each configuration, and its median tok/s.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, host_info  # noqa: E402

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base_dir: Path, root: Path, rank: int) -> dict[str, str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    out = {}
    for seed, name in enumerate(("a1", "a2"), start=1):
        torch.manual_seed(seed)
        model = get_peft_model(copy.deepcopy(hf), LoraConfig(
            r=rank, lora_alpha=rank, target_modules=LINEARS, init_lora_weights=False))
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.model.sources import default_model_gguf, gguf_to_hf_dir
    from batchinfer.engine.request import Request, SamplingParams

    base_dir = Path(gguf_to_hf_dir(default_model_gguf()))
    prompts = [[1 + (i * 37 + j * 11) % 4000 for j in range(24 + i)] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

    def engine(adapters: dict) -> Engine:
        return Engine.from_config(EngineConfig(
            model={"path": str(base_dir), "dtype": "float32", "max_model_len": 512,
                   "lora_modules": adapters, "max_lora_rank": args.rank},
            cache={"kv_cache_memory": "256MiB"}))

    def run(eng: Engine, lora_of, tag: str) -> float:
        for i, p in enumerate(prompts):
            eng.add_request(Request(f"{tag}-{i}", p, params, lora=lora_of(i)))
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        return time.perf_counter() - t

    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(base_dir, Path(tmp), args.rank)
        plain, loaded = engine({}), engine(adapters)
        configs = {"plain": (plain, lambda i: None), "loaded_base": (loaded, lambda i: None),
                   "loaded_mixed": (loaded, lambda i: [None, "a1", "a2"][i % 3]),
                   "loaded_one": (loaded, lambda i: "a1")}
        for name, (eng, lora_of) in configs.items():     # warm-up: kernels, first-step costs
            run(eng, lora_of, f"warm-{name}")
        seconds: dict[str, list[float]] = {name: [] for name in configs}
        for rep in range(args.repeats):
            for name, (eng, lora_of) in configs.items():
                seconds[name].append(round(run(eng, lora_of, f"{rep}-{name}"), 3))
    tokens = args.requests * args.tokens
    emit({"host": host_info(), "requests": args.requests, "output_tokens": args.tokens,
          "rank": args.rank, "seconds": seconds,
          "tok_per_s_median": {k: round(tokens / statistics.median(v), 1)
                               for k, v in seconds.items()}})


if __name__ == "__main__":
    main()
