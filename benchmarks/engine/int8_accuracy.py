"""How far `model.quantization: int8` moves the model: teacher-forced next-token log-probs and
greedy continuations against the same engine in fp32, on real ShareGPT conversations.

Teacher-forced: each of --conversations ShareGPT V3 pairs (first human turn through the chat
template, then the reference reply; the first --offset complete pairs of the dataset skipped, at
most --max-len tokens) runs as one prefill through our fp32 model and through the int8 ones (the LM
head in fp32, and in int8 too), and, for scale, with bf16 weights (`dtype: bfloat16`). Per
position: whether the top-1 token agrees, |difference| of the log-prob of the text's actual next
token (mean, p99, max), and KL(fp32 || it) (mean). Our fp32 path equals transformers' fp32 within
4e-5 in log-prob (tests/engine/test_cpu_bf16.py), so it stands for the model. Greedy: the first --greedy prompts, --greedy-tokens tokens each,
through an engine per configuration: the share of continuations identical to fp32's and the
mean length of the common prefix.

    python benchmarks/engine/int8_accuracy.py                       # 64 conversations, 32 greedy
    python benchmarks/engine/int8_accuracy.py --conversations 16 --greedy 8   # quick

Prints one JSON object with the host's CPU model and flags.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, host_info, teacher_forced_logprobs  # noqa: E402

# against fp32: int8 two ways, and bf16 weights (what `dtype: auto` runs on a CPU with native bf16)
# for scale
CONFIGS = {"int8": {"quantization": "int8"},
           "int8-lm-head": {"quantization": "int8", "quantize_lm_head": True},
           "bf16-weights": {"dtype": "bfloat16"}}


def conversations(tokenizer, n: int, offset: int, max_len: int) -> list[tuple[list[int], str]]:
    """(token ids of the templated prompt and its reference reply, the templated prompt)."""
    from batchinfer.bench.workloads import sharegpt_pairs

    out = []
    for prompt, reply in itertools.islice(sharegpt_pairs(), offset, None):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             tokenize=False, add_generation_prompt=True)
        ids = tokenizer(chat + reply, add_special_tokens=False)["input_ids"][:max_len]
        if len(ids) >= 16 and len(tokenizer(chat)["input_ids"]) < max_len:
            out.append((ids, chat))
        if len(out) == n:
            return out
    return out


def compare(reference: list, ours: list, texts: list[list[int]]) -> dict:
    import torch

    agree = total = 0
    diffs, kls = [], []
    for ref, got, ids in zip(reference, ours, texts):
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        total += len(ids)
        nxt = torch.tensor(ids[1:])[:, None]
        diffs += (ref[:-1].gather(1, nxt) - got[:-1].gather(1, nxt)).abs().flatten().tolist()
        kls += (ref.exp() * (ref - got)).sum(-1).tolist()
    diffs.sort()
    return {"positions": total, "top1_agreement": round(agree / total, 4),
            "logprob_diff_mean": round(statistics.mean(diffs), 4),
            "logprob_diff_p99": round(diffs[int(0.99 * (len(diffs) - 1))], 4),
            "logprob_diff_max": round(diffs[-1], 4), "kl_mean": round(statistics.mean(kls), 5)}


def greedy(prompts: list[str], tokens: int, model: dict) -> list[list[int]]:
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import SamplingParams

    with Engine.from_config(EngineConfig(model={"max_model_len": 2048, **model},
                                         cache={"kv_cache_memory": "1GiB"})) as engine:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        return [o.output_token_ids for o in engine.generate(prompts, params)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--offset", type=int, default=5000, help="complete ShareGPT pairs skipped "
                    "first (the predictor's and the benchmarks' samples come from the start)")
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--greedy", type=int, default=32, help="prompts continued greedily")
    ap.add_argument("--greedy-tokens", type=int, default=64)
    args = ap.parse_args()

    import torch

    from batchinfer.engine.attention import select_backend
    from batchinfer.engine.build import model_source
    from batchinfer.engine.config import ModelConfig
    from batchinfer.engine.model.int8_linear import resolve_quantization
    from batchinfer.engine.model.loader import build_model
    from batchinfer.engine.model.ops import NativeOps

    from transformers import AutoTokenizer

    source = model_source(ModelConfig())
    tokenizer = AutoTokenizer.from_pretrained(str(source.model_dir))
    pairs = conversations(tokenizer, args.conversations, args.offset, args.max_len)
    texts = [ids for ids, _ in pairs]
    cpu = torch.device("cpu")
    backend = select_backend("auto", cpu, torch.float32)

    def logprobs(quantization, dtype=torch.float32) -> list:
        model = build_model(source.model_dir, source.arch, dtype, cpu, args.max_len,
                            quantization=quantization)
        if backend.name == "native":
            model.use_ops(NativeOps)
        return [teacher_forced_logprobs(model, backend, source.arch, ids) for ids in texts]

    reference = logprobs(None)
    report = {"host": host_info(), "model": source.model_id, "conversations": len(texts),
              "offset": args.offset, "max_len": args.max_len, "teacher_forced": {}, "greedy": {}}
    for name, model in CONFIGS.items():
        dtype = getattr(torch, model.get("dtype", "float32"))
        quantization = resolve_quantization(model.get("quantization"),
                                            model.get("quantize_lm_head", False), cpu, dtype)
        report["teacher_forced"][name] = compare(reference, logprobs(quantization, dtype), texts)
    prompts = [chat for _, chat in pairs[:args.greedy]]
    base = greedy(prompts, args.greedy_tokens, {"dtype": "float32"})
    for name, model in CONFIGS.items():
        got = greedy(prompts, args.greedy_tokens, {"dtype": "float32", **model})
        prefixes = [common_prefix(a, b) for a, b in zip(base, got)]
        report["greedy"][name] = {"prompts": len(prompts), "tokens": args.greedy_tokens,
                                  "identical": round(statistics.mean(p == args.greedy_tokens
                                                                     for p in prefixes), 3),
                                  "mean_common_prefix": round(statistics.mean(prefixes), 1)}
    emit(report)


if __name__ == "__main__":
    main()
