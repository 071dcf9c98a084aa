"""Qwen3 (dense): the Llama layer with q and k RMS-normalized head by head before RoPE."""
from __future__ import annotations

from . import llama

DecoderLayer = llama.DecoderLayer

COMPLETE_WITH_TRANSFORMERS = True


def read_config(cfg: dict) -> dict:
    bias = bool(cfg.get("attention_bias", False))
    return {"qk_norm": "head", "qkv_bias": bias, "o_bias": bias}
