"""Phi-3 / Phi-3.5 / Phi-4 (and their mini models): the Llama layer over a checkpoint that stores
qkv_proj and gate_up_proj fused (the engine's own layout: the loader only slices them for a TP
rank), LongRoPE scaling (rope.py), RoPE on part of each head (Phi-4-mini) and, where the config has
one, a sliding window on every layer (Phi-3-mini-4k: 2,047 keys)."""
from __future__ import annotations

from . import llama
from .arch import sliding_windows

DecoderLayer = llama.DecoderLayer

COMPLETE_WITH_TRANSFORMERS = True


def read_config(cfg: dict) -> dict:
    return {"qkv_bias": False, "o_bias": False, "fused_checkpoint": True,
            "layer_windows": sliding_windows(cfg)}
