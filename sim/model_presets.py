"""The papers' models as architecture facts (their public config.json fields), for planning runs
of models whose weights are not on this machine. Only shapes: nothing here loads weights."""
from __future__ import annotations

from batchinfer.engine.model.arch import ModelArch, arch_from_dict


def _llama(hidden, inter, layers, heads, kv_heads, vocab, max_pos, **extra) -> dict:
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab,
            "max_position_embeddings": max_pos, **extra}


def _qwen2(hidden, inter, layers, heads, kv_heads, max_pos) -> dict:
    return {**_llama(hidden, inter, layers, heads, kv_heads, 152064, max_pos),
            "model_type": "qwen2"}


MODEL_PRESETS: dict[str, dict] = {
    "llama2-13b": _llama(5120, 13824, 40, 40, 40, 32000, 4096),          # TD-Pipe, Seesaw
    "codellama-34b": _llama(8192, 22016, 48, 64, 8, 32000, 16384),       # Seesaw
    "llama3.1-70b": _llama(8192, 28672, 80, 64, 8, 128256, 131072),      # Seesaw, SiDP
    "qwen2.5-14b": _qwen2(5120, 13824, 48, 40, 8, 32768),                # gLLM
    "qwen2.5-32b": _qwen2(5120, 27648, 64, 40, 8, 32768),                # TD-Pipe, gLLM
    "qwen2.5-72b": _qwen2(8192, 29568, 80, 64, 8, 32768),                # SiPipe, SiDP
    # a mixture of experts (issue 42's GPU figure): 128 experts of 768, top 8 (3.3 B active)
    "qwen3-30b-a3b": {**_llama(2048, 6144, 48, 32, 4, 151936, 40960), "model_type": "qwen3_moe",
                      "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True},
}


def model_preset(name: str) -> ModelArch:
    try:
        cfg = MODEL_PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: "
                         f"{', '.join(sorted(MODEL_PRESETS))}") from None
    return arch_from_dict(cfg, f"model preset {name}")
