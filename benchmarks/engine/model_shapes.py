"""Model directories of real shapes for dummy-weight CPU runs, ours and vLLM's (issue 42).

Each directory holds a config.json and the embedded SmolLM2 tokenizer's files (both engines then
tokenize the same prompts into the same ids, all below every shape's vocabulary), and nothing else:
with `load_format: dummy` (ours) and `--dummy` (vLLM) both build the model at that size with random
weights. Shapes (fp32 must fit the project's 24 GiB host):

- `qwen3-0.6b`: Qwen/Qwen3-0.6B (dense, q/k norms, tied embeddings), 0.6 B parameters, 2.4 GB fp32;
- `qwen3-moe-2l`: Qwen3-30B-A3B's layer (128 experts of 768, top 8) on 2 of its 48 layers,
  1.8 B parameters (0.36 B active per token), 7.3 GB fp32: a mixture of experts at real width.

    python benchmarks/engine/model_shapes.py                 # prints {name: directory}
    python benchmarks/engine/w_decode.py --model "$(python benchmarks/engine/model_shapes.py \\
        --print qwen3-moe-2l)" --load-format dummy --max-tokens 64 --concurrency 64
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import REPO, embedded_source  # noqa: E402

QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645,
}


def shapes() -> dict[str, dict]:
    moe = json.loads((REPO / "examples" / "model-configs" / "qwen3-30b-a3b" / "config.json")
                     .read_text())
    return {"qwen3-0.6b": QWEN3_06B,
            "qwen3-moe-2l": {**moe, "num_hidden_layers": 2, "max_window_layers": 2}}


def shape_dir(name: str) -> Path:
    from batchinfer.engine.setup_cache import cache_root

    config = shapes()[name]
    out = cache_root() / "model-shapes" / name
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = Path(embedded_source().model_dir)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--print", dest="only", choices=sorted(shapes()), default=None,
                    help="print only this shape's directory")
    args = ap.parse_args()
    if args.only:
        print(shape_dir(args.only))
        return
    print(json.dumps({name: str(shape_dir(name)) for name in shapes()}, indent=1))


if __name__ == "__main__":
    main()
