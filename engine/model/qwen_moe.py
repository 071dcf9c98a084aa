"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): the
Qwen layer whose feed-forward is a mixture of experts (moe.py). Qwen2-MoE has q/k/v biases and a
sigmoid-gated shared expert; Qwen3-MoE normalizes q and k head by head, as dense Qwen3 does."""
from __future__ import annotations

from .arch import sliding_windows
from .moe import MoEDecoderLayer, read_moe

DecoderLayer = MoEDecoderLayer

COMPLETE_WITH_TRANSFORMERS = True   # its defaults (norm_topk_prob, qkv_bias, ...) are its own


def read_config(cfg: dict) -> dict:
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if cfg["model_type"] == "qwen2_moe":
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        return {"qkv_bias": bool(cfg.get("qkv_bias", True)), "o_bias": False,
                "layer_windows": sliding_windows(cfg) if cfg.get("use_sliding_window") else (),
                "moe": read_moe(cfg, experts, shared_rows=shared)}
    bias = bool(cfg.get("attention_bias", False))
    return {"qk_norm": "head", "qkv_bias": bias, "o_bias": bias,
            "layer_windows": sliding_windows(cfg) if cfg.get("use_sliding_window") else (),
            "moe": read_moe(cfg, experts)}
