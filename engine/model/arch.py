"""The architecture facts the engine needs, read from a Hugging Face config.json.

Supported: the Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral) and Qwen2 (qkv bias). Anything
else is a clear error naming the file and the architectures we run.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..errors import ModelLoadError

SUPPORTED_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: Optional[int]
    bos_token_id: Optional[int]
    eos_token_ids: tuple[int, ...]
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def flops_per_token(self) -> int:
        """Matmul FLOPs per token, attention scores excluded (2 x the non-embedding weights + head)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i
        return 2 * (self.num_layers * per_layer + v * h)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def arch_from_dict(cfg: dict, source: str = "config.json") -> ModelArch:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = cfg.get("architectures")
        raise ModelLoadError(
            f"{source}: model_type {model_type!r} (architectures {archs}) is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))} (Llama 2/3, SmolLM2, TinyLlama, "
            "Mistral, Qwen2)")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or {}
        rope_theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        head_dim = cfg.get("head_dim") or hidden // heads
        arch = ModelArch(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            sliding_window=(cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
            raw=cfg,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{source}: missing required field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: malformed field: {exc}") from None
    if arch.num_heads % arch.num_kv_heads:
        raise ModelLoadError(f"{source}: num_attention_heads ({arch.num_heads}) is not a multiple of "
                             f"num_key_value_heads ({arch.num_kv_heads})")
    if arch.head_dim % 2:
        raise ModelLoadError(f"{source}: head_dim must be even for rotary embeddings, got {arch.head_dim}")
    if arch.rope_scaling:
        kind = arch.rope_scaling.get("rope_type", arch.rope_scaling.get("type", "default"))
        if kind not in ("default", "linear", "llama3", "dynamic"):
            raise ModelLoadError(f"{source}: rope scaling type {kind!r} is not supported; "
                                 "supported: default, linear, llama3, dynamic (treated as default "
                                 "within max_position_embeddings)")
    if math.isnan(arch.rms_norm_eps):
        raise ModelLoadError(f"{source}: rms_norm_eps is NaN")
    return arch


def read_arch(model_dir: Path) -> ModelArch:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: no config.json; a model directory needs config.json, "
                             "*.safetensors weights and tokenizer files")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    return arch_from_dict(cfg, str(path))
