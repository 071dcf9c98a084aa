"""The model families the engine runs: config.json's model_type -> the module that implements it.

A family module under engine/model/ defines `COMPLETE_WITH_TRANSFORMERS` (True: config.json is
first completed by transformers' own config class, which fills in the defaults saved files omit),
`read_config(cfg) -> dict` (its ModelArch fields beyond the generic ones) and `DecoderLayer` (one
layer, over the shared blocks in decoder.py, with `NORMS`: its norms' checkpoint names). A new
family is one such module plus a line here (and its names in MODEL_NAMES).
Modules are imported on first use, so reading a config does not build every family's layers.
"""
from __future__ import annotations

import importlib
from types import ModuleType

# model_type -> family module (engine/model/<module>.py)
FAMILIES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "qwen3",
    "olmo2": "olmo2",
    "phi3": "phi3",
    "gemma2": "gemma",
    "gemma3_text": "gemma",
    "qwen2_moe": "qwen_moe",
    "qwen3_moe": "qwen_moe",
    "mixtral": "mixtral",
    "gpt_oss": "gpt_oss",
}

# vision-language model_type -> (its language model's model_type, the prefix of the language
# model's tensors in the checkpoint): the engine runs the language model on text and skips the
# vision tower and projector
LANGUAGE_MODELS: dict[str, tuple[str, str]] = {
    "gemma3": ("gemma3_text", "language_model."),
}

# model_type -> the models users know it by (the unsupported-architecture message lists these)
MODEL_NAMES: dict[str, str] = {
    "llama": "Llama 2 / 3.x, SmolLM2, TinyLlama",
    "mistral": "Mistral",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3 (dense)",
    "olmo2": "OLMo 2",
    "phi3": "Phi-3 / Phi-3.5 / Phi-4 (incl. mini)",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 1B",
    "gemma3": "Gemma 3 4B / 12B / 27B: the language model, on text",
    "qwen2_moe": "Qwen1.5-MoE / Qwen2-57B-A14B",
    "qwen3_moe": "Qwen3-30B-A3B / Qwen3-235B-A22B",
    "mixtral": "Mixtral 8x7B / 8x22B",
    "gpt_oss": "gpt-oss-20b / gpt-oss-120b",
}


def family_module(model_type: str) -> ModuleType:
    """The module implementing `model_type` (KeyError if none does)."""
    return importlib.import_module(f"{__package__}.{FAMILIES[model_type]}")


def supported_models() -> str:
    """'llama (Llama 2 / 3.x, ...), mistral (Mistral), ...' for error messages."""
    return ", ".join(f"{t} ({MODEL_NAMES[t]})" for t in sorted({*FAMILIES, *LANGUAGE_MODELS}))
