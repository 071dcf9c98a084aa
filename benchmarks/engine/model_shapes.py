"""Model directories of real shapes for dummy-weight CPU runs, ours and vLLM's (issue 42).

Each directory holds a config.json and the embedded SmolLM2 tokenizer's files (both engines then
tokenize the same prompts into the same ids, all below every shape's vocabulary), and nothing else:
with `load_format: dummy` (ours) and `--dummy` (vLLM) both build the model at that size with random
weights. Shapes (fp32 must fit the project's 24 GiB host):

- `qwen3-0.6b`: Qwen/Qwen3-0.6B (dense, q/k norms, tied embeddings), 0.6 B parameters, 2.4 GB fp32;
- `qwen3-moe-2l`: Qwen3-30B-A3B's layer (128 experts of 768, top 8) on 2 of its 48 layers,
  1.8 B parameters (0.36 B active per token), 7.3 GB fp32: a mixture of experts at real width;
- `gemma3-1b-6l`: google/gemma-3-1b-pt's layers (512-key sliding windows, one kv head of 256)
  on 6 of its 26, one period of its pattern (5 windowed layers, then a global one), with its
  262,144-token vocabulary: 0.46 B parameters, 1.8 GB fp32 (benchmarks/engine/window_groups.py).

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


GEMMA3_1B_6L = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 6,
    "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": 512, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 262144,
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}


def shapes() -> dict[str, dict]:
    moe = json.loads((REPO / "examples" / "model-configs" / "qwen3-30b-a3b" / "config.json")
                     .read_text())
    return {"qwen3-0.6b": QWEN3_06B, "gemma3-1b-6l": GEMMA3_1B_6L,
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
