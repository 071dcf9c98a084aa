"""Mixtral (8x7B, 8x22B): Mistral's layer whose feed-forward is a mixture of experts (moe.py),
every layer sparse, the top-k routing weights always renormalized; the checkpoint keeps the
experts under block_sparse_moe with w1 (gate), w3 (up) and w2 (down)."""
from __future__ import annotations

from .arch import sliding_windows
from .moe import MoEDecoderLayer, read_moe

DecoderLayer = MoEDecoderLayer

COMPLETE_WITH_TRANSFORMERS = True


def read_config(cfg: dict) -> dict:
    moe = read_moe({**cfg, "norm_topk_prob": True}, int(cfg["num_local_experts"]),
                   block_name="block_sparse_moe", projections=("w1", "w3", "w2"),
                   intermediate_key="intermediate_size")
    return {"qkv_bias": False, "o_bias": False, "layer_windows": sliding_windows(cfg), "moe": moe}
