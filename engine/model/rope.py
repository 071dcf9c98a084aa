"""Rotary position embeddings: the inverse frequencies of each RoPE type and the cos/sin tables.

The tables are [max_positions, rotary_width / 2], indexed by position, so every ops.rotary kernel
reads them the same way whatever the scaling. LongRoPE (Phi-3 / Phi-4) has two sets of
frequencies, short and long. Each position here takes its set from where it is: short below
original_max_position_embeddings, long from there on, fixed once its K/V is cached, as a paged
cache needs. transformers decides per sequence instead: short while the whole sequence fits the
original length, and when it grows past it, Phi-3's generate drops its cache and recomputes every
position with the long set. The two agree token for token on every sequence within the original
length (4,096 tokens on the 128k Phi-3 / Phi-4 models); past it, the tokens before that length
keep their short-set keys here.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .arch import ModelArch, rope_kind


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(arch: ModelArch, rope: Optional[tuple] = None, long: bool = False) -> torch.Tensor:
    """The inverse frequencies of `arch`'s RoPE, or of `rope` = (theta, scaling or None);
    `long`: the LongRoPE long set."""
    theta, scaling = rope if rope is not None else (arch.rope_theta, arch.rope_scaling)
    scaling = scaling or {}
    dim, kind = arch.rotary_size, rope_kind(scaling)
    if kind == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "yarn":
        return _yarn(theta, dim, scaling, arch.max_position_embeddings)
    inv_freq = default_inv_freq(theta, dim)
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    return inv_freq


def _yarn(theta: float, dim: int, scaling: dict, max_positions: int) -> torch.Tensor:
    """YaRN (GPT-OSS; Qwen2.5 / Qwen3's long-context configs): each frequency blended between its
    interpolated (divided by `factor`) and its original value by a linear ramp over the
    dimensions between the beta_fast and beta_slow rotation counts of the original context
    (transformers' _compute_yarn_parameters)."""
    factor = scaling.get("factor")
    original = _yarn_original(scaling)
    factor = float(factor) if factor is not None else max_positions / original
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _yarn_original(scaling: dict) -> float:
    """YaRN's original_max_position_embeddings; a ModelLoadError naming it where the config
    lacks it (arch._check refuses such a config.json first; this covers a family's own rope)."""
    original = scaling.get("original_max_position_embeddings")
    if original is None:
        from ..errors import ModelLoadError

        raise ModelLoadError(f"rope scaling type 'yarn' needs 'original_max_position_embeddings' "
                             f"in its rope_scaling / rope_parameters, got {scaling}")
    return float(original)


def yarn_attention_factor(scaling: dict, max_positions: int) -> float:
    """cos and sin are scaled by this: `attention_factor`, else 0.1 ln(factor) + 1 (with
    mscale / mscale_all_dim where given)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_positions / _yarn_original(scaling)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def longrope_attention_factor(arch: ModelArch, scaling: dict) -> float:
    """cos and sin are scaled by this (transformers' default from the context extension)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or arch.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class Rotary(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by position; `rope` = (theta,
    scaling or None) instead of the model's (a family's local layers may have their own)."""

    def __init__(self, arch: ModelArch, max_positions: int, rope: Optional[tuple] = None):
        super().__init__()
        self.arch, self.max_positions, self.rope = arch, max_positions, rope
        half = arch.rotary_size // 2
        self.register_buffer("cos", torch.empty(max_positions, half), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, half), persistent=False)
        if self.cos.device.type != "meta":
            self.reset()

    def reset(self) -> None:
        """(Re)computes the tables on the buffers' device (after building on the meta device)."""
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        scaling = (self.arch.rope_scaling if self.rope is None else self.rope[1]) or {}
        freqs = torch.outer(pos, rope_inv_freq(self.arch, self.rope))
        cos, sin = freqs.cos(), freqs.sin()
        if rope_kind(scaling) == "longrope":
            original = int(scaling["original_max_position_embeddings"])
            if self.max_positions > original:
                long = torch.outer(pos[original:], rope_inv_freq(self.arch, self.rope, long=True))
                cos[original:], sin[original:] = long.cos(), long.sin()
            factor = longrope_attention_factor(self.arch, scaling)
            cos, sin = cos * factor, sin * factor
        elif rope_kind(scaling) == "yarn":
            factor = yarn_attention_factor(scaling, self.arch.max_position_embeddings)
            cos, sin = cos * factor, sin * factor
        self.cos = cos.to(self.cos.device)
        self.sin = sin.to(self.sin.device)


def partial_rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   num_heads: int, head_dim: int) -> torch.Tensor:
    """ops.rotary for RoPE on the first 2 x cos.shape[1] of each head (the rest passes through):
    rotates the first `num_heads` heads of x [T, heads * head_dim]; returns the new x."""
    tokens, rot = x.shape[0], 2 * cos.shape[1]
    heads = x.view(tokens, -1, head_dim)
    part = heads[:, :num_heads, :rot]
    c = cos[positions].unsqueeze(1).to(x.dtype)
    s = sin[positions].unsqueeze(1).to(x.dtype)
    x1, x2 = part.chunk(2, dim=-1)
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, heads[:, :num_heads, rot:]), dim=-1)
    return torch.cat((rotated, heads[:, num_heads:]), dim=1).reshape(tokens, -1)
