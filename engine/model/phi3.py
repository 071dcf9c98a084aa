"""Phi-3 / Phi-3.5 / Phi-4 (and their mini models): the Llama layer over a checkpoint that stores
qkv_proj and gate_up_proj fused (the engine's own layout: the loader only slices them for a TP
rank), LongRoPE scaling (rope.py) and, on Phi-4-mini, RoPE on part of each head."""
from __future__ import annotations

from . import llama

DecoderLayer = llama.DecoderLayer

COMPLETE_WITH_TRANSFORMERS = True


def read_config(cfg: dict) -> dict:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (Phi-3 uses silu)")
    return {"qkv_bias": False, "o_bias": False, "fused_checkpoint": True}
