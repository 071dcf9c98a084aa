"""Qwen3 (dense): the Llama layer with q and k RMS-normalized head by head before RoPE."""
from __future__ import annotations

from . import llama
from .arch import sliding_windows

DecoderLayer = llama.DecoderLayer

COMPLETE_WITH_TRANSFORMERS = True


def read_config(cfg: dict) -> dict:
    bias = bool(cfg.get("attention_bias", False))
    return {"qk_norm": "head", "qkv_bias": bias, "o_bias": bias,
            "layer_windows": sliding_windows(cfg)}   # use_sliding_window: the layers from
                                                     # max_window_layers on
