"""The architecture facts the engine needs, read from a Hugging Face config.json.

The generic fields (sizes, heads, RoPE, norms' epsilon) are read here for every family; each
family module (registry.py lists them) adds what sets it apart (q/k norms, norm placement,
soft-capping, ...). Anything else is a clear error naming the file, the architectures we run and
how to run it anyway (`strategy: vllm`).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..errors import ModelLoadError
from .registry import FAMILIES, LANGUAGE_MODELS, family_module, supported_models

ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "longrope", "yarn")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts model's feed-forward: each token's router picks `top_k` of
    `num_experts` gated MLPs (moe.py). The checkpoint keeps them under `block_name` (mlp,
    Mixtral's block_sparse_moe), each expert's projections named `projections` (gate, up, down)."""

    num_experts: int
    top_k: int
    intermediate_size: int               # each expert's
    norm_topk_prob: bool                 # the top-k routing weights renormalized to sum to 1
    sparse_layers: tuple[bool, ...]      # per layer: experts (True) or the dense MLP
    shared_intermediate_size: int = 0    # Qwen2-MoE's shared expert (sigmoid-gated); 0: none
    block_name: str = "mlp"
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # GPT-OSS (gpt_oss.py): the router is a biased linear whose top-k logits are softmaxed
    # ("topk_softmax"; the others softmax all logits, then take the top k), the experts have
    # biases and the clamped SwiGLU (alpha, limit), and the checkpoint stacks them per layer
    # (gate and up interleaved), in MXFP4 blocks and scales where `mxfp4`
    routing: str = "softmax_topk"
    expert_bias: bool = False
    swiglu: Optional[tuple[float, float]] = None   # (alpha, limit); None: SiLU-and-mul
    stacked_checkpoint: bool = False
    mxfp4: bool = False

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)


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
    # --- what sets a family apart (the defaults are the Llama family's) ---------------------------
    o_bias: bool = False                 # o_proj has a bias (added once, after the TP all-reduce)
    qk_norm: Optional[str] = None        # RMSNorm of q and k before RoPE: "head" (over each head:
                                         # Qwen3), "full" (over all heads at once: OLMo 2)
    rotary_dim: Optional[int] = None     # RoPE on the first rotary_dim of each head (Phi-4-mini's
                                         # partial_rotary_factor); None: all of it
    fused_checkpoint: bool = False       # the checkpoint stores qkv_proj and gate_up_proj (Phi-3)
    checkpoint_layers: Optional[int] = None  # the checkpoint's layers when hf_overrides ran fewer
    hidden_act: str = "silu"             # the MLP's gate activation: silu, gelu_pytorch_tanh (GeGLU)
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window (0: global); (): none masked
    local_rope: Optional[tuple] = None   # (theta, scaling) of the sliding-window layers' RoPE
                                         # where it is not the global one (Gemma 3)
    norm_offset: float = 0.0             # RMSNorm scales by offset + weight (Gemma: 1 + w; folded
                                         # into the weights at load)
    embedding_scale: Optional[float] = None  # embeddings times this (Gemma: sqrt(hidden_size))
    attention_scale: Optional[float] = None  # None: head_dim ** -0.5
    attn_softcap: float = 0.0            # scores -> cap * tanh(scores / cap) (Gemma 2); 0: none
    final_softcap: float = 0.0           # the same on the logits
    checkpoint_prefix: str = ""          # where a vision-language checkpoint keeps the language
                                         # model's tensors (the rest is skipped)
    moe: Optional[MoESpec] = None        # mixture-of-experts feed-forward (Qwen-MoE, Mixtral)
    attention_sinks: bool = False        # a learned logit per head in each softmax's denominator
                                         # (GPT-OSS: `self_attn.sinks`)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_size(self) -> int:
        """The rotated width of each head."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in keys (0: it sees the whole sequence)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def kv_window(self) -> int:
        """The window every layer has (the widest of them): keys before it are never read again,
        so the KV cache may release them. 0 when some layer attends to the whole sequence (its
        KV is needed to the end: such a model releases per layer group, kv_groups.py)."""
        if not self.layer_windows or not all(self.layer_windows):
            return 0
        return max(self.layer_windows)

    def context_limit(self) -> int:
        """The longest sequence the model runs: max_position_embeddings, and the sliding window
        where the family does not mask windows (Qwen2's, whose window applies from
        max_window_layers on: within it, attention is full attention)."""
        if self.sliding_window and not self.layer_windows:
            return min(self.max_position_embeddings, int(self.sliding_window))
        return self.max_position_embeddings

    def is_sparse(self, layer: int) -> bool:
        """Layer `layer`'s feed-forward is a mixture of experts."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    def _ffn_weights(self, active: bool) -> int:
        """The feed-forward weights of all layers; `active`: only those one token runs (its
        top_k experts, the router and the shared expert), not every expert."""
        h, dense = self.hidden_size, 3 * self.hidden_size * self.intermediate_size
        if self.moe is None:
            return self.num_layers * dense
        m = self.moe
        experts = m.top_k if active else m.num_experts
        sparse = (3 * h * m.intermediate_size * experts + h * m.num_experts
                  + (3 * h * m.shared_intermediate_size + h if m.shared_intermediate_size else 0))
        return m.num_sparse_layers * sparse + (self.num_layers - m.num_sparse_layers) * dense

    def ffn_activation_width(self) -> int:
        """Values one token's feed-forward holds at once: gate/up and its product for a dense
        MLP; for a sparse layer its top_k copies gathered in and out, each expert's gate/up and
        product, and the shared expert's (the widest layer kind counts)."""
        dense = 3 * self.intermediate_size
        if self.moe is None:
            return dense
        m = self.moe
        sparse = (m.top_k * (2 * self.hidden_size + 3 * m.intermediate_size)
                  + 3 * m.shared_intermediate_size)
        return max(sparse, dense if m.num_sparse_layers < self.num_layers else 0)

    def num_params(self) -> int:
        h, v = self.hidden_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + self._ffn_weights(False) + h + head

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def flops_per_token(self) -> int:
        """Matmul FLOPs per token, attention scores excluded (2 x the non-embedding weights a
        token runs through + head: a mixture of experts counts its top_k experts)."""
        h, v = self.hidden_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        return 2 * (self.num_layers * per_layer + self._ffn_weights(True) + v * h)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def rope_kind(scaling: Optional[dict]) -> str:
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def unsupported_architecture(model_type: Any, archs: Any, source: str) -> ModelLoadError:
    return ModelLoadError(
        f"{source}: model_type {model_type!r} (architectures {archs}) is not supported by the "
        f"batchinfer engine; supported: {supported_models()}. To run it anyway, set "
        "`strategy: {name: vllm}` in the recipe: an installed vLLM runs the job "
        "(pip install 'batchinfer[vllm]'; recipes/vllm.yaml)")


def _generic_fields(cfg: dict) -> dict:
    """ModelArch's fields every family reads the same way (KeyError: a required one is missing)."""
    model_type = cfg["model_type"]
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    rope = cfg.get("rope_parameters") or {}
    rope_theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (rope if rope_kind(rope) != "default" else None)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor"))
    return dict(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=dict(scaling) if scaling else None,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        sliding_window=(cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        rotary_dim=(int(head_dim * float(partial)) if partial not in (None, 1, 1.0) else None),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
        raw=cfg,
    )


def arch_from_dict(cfg: dict, source: str = "config.json") -> ModelArch:
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES and model_type not in LANGUAGE_MODELS:
        raise unsupported_architecture(model_type, cfg.get("architectures"), source)
    try:
        prefix = ""
        if model_type in LANGUAGE_MODELS:   # a vision-language checkpoint: its language model
            cfg, prefix = _language_model_config(cfg)
        family = family_module(cfg["model_type"])
        if family.COMPLETE_WITH_TRANSFORMERS:
            cfg = transformers_config(cfg)
        fields = _generic_fields(cfg)
        fields.update(family.read_config(cfg), checkpoint_prefix=prefix)
        arch = ModelArch(**fields)
    except KeyError as exc:
        raise ModelLoadError(f"{source}: missing required field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: malformed field: {exc}") from None
    except Exception as exc:       # transformers' own config validation (huggingface_hub's)
        if type(exc).__module__.split(".")[0] not in ("transformers", "huggingface_hub"):
            raise
        raise ModelLoadError(f"{source}: transformers rejects this config: {exc}") from None
    _check(arch, source)
    return arch


def _check(arch: ModelArch, source: str) -> None:
    if arch.num_heads % arch.num_kv_heads:
        raise ModelLoadError(f"{source}: num_attention_heads ({arch.num_heads}) is not a multiple of "
                             f"num_key_value_heads ({arch.num_kv_heads})")
    if arch.head_dim % 2 or arch.rotary_size % 2 or not 0 < arch.rotary_size <= arch.head_dim:
        raise ModelLoadError(f"{source}: the rotary width must be even and within head_dim, got "
                             f"{arch.rotary_size} of head_dim {arch.head_dim}")
    if arch.rope_scaling and rope_kind(arch.rope_scaling) not in ROPE_TYPES:
        raise ModelLoadError(f"{source}: rope scaling type {rope_kind(arch.rope_scaling)!r} is not "
                             f"supported; supported: {', '.join(ROPE_TYPES)} (dynamic is treated as "
                             "default within max_position_embeddings)")
    if arch.rope_scaling and rope_kind(arch.rope_scaling) == "yarn" and \
            arch.rope_scaling.get("original_max_position_embeddings") is None:
        raise ModelLoadError(f"{source}: rope scaling type 'yarn' needs "
                             "'original_max_position_embeddings' (the pretraining context the "
                             f"ramp is measured against) in its rope_scaling / rope_parameters, "
                             f"got {arch.rope_scaling}")
    if math.isnan(arch.rms_norm_eps):
        raise ModelLoadError(f"{source}: rms_norm_eps is NaN")
    if arch.hidden_act not in ACTIVATIONS:
        raise ModelLoadError(f"{source}: hidden activation {arch.hidden_act!r} is not supported; "
                             f"supported: {', '.join(ACTIVATIONS)}")
    moe = arch.moe
    if moe is not None and not (0 < moe.top_k <= moe.num_experts
                                and len(moe.sparse_layers) == arch.num_layers):
        raise ModelLoadError(f"{source}: {moe.top_k} experts per token of {moe.num_experts} "
                             f"experts, {len(moe.sparse_layers)} layer kinds for "
                             f"{arch.num_layers} layers: a mixture of experts needs "
                             "0 < experts per token <= experts and a kind per layer")
    if arch.layer_windows and len(arch.layer_windows) != arch.num_layers:
        raise ModelLoadError(f"{source}: {len(arch.layer_windows)} layer types for "
                             f"{arch.num_layers} layers")


def sliding_windows(cfg: dict) -> tuple[int, ...]:
    """Each layer's window from a completed config: its layer_types where it has them, else the
    one sliding_window on every layer; () without a window."""
    window = cfg.get("sliding_window")
    if not window:
        return ()
    types = cfg.get("layer_types")
    if types:
        return tuple(int(window) if kind == "sliding_attention" else 0 for kind in types)
    return (int(window),) * int(cfg["num_hidden_layers"])


def _language_model_config(cfg: dict) -> tuple[dict, str]:
    """A vision-language config -> its language model's (completed by transformers; the outer
    config's token ids win, as its generation uses them) and the prefix of its tensors."""
    text_type, prefix = LANGUAGE_MODELS[cfg["model_type"]]
    text = dict(transformers_config(cfg)["text_config"], model_type=text_type)
    for key in ("bos_token_id", "eos_token_id"):
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    return text, prefix


def transformers_config(cfg: dict) -> dict:
    """The config dict completed by transformers' own config class for its model_type: every
    default it fills in (config.json files saved by transformers omit them) and RoPE parameters
    in its standard form (rope_parameters). For families whose defaults are not the generic ones."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[cfg["model_type"]].from_dict(dict(cfg))
    return {**config.to_dict(), "model_type": cfg["model_type"]}


def with_generation_eos(arch: ModelArch, model_dir: Path) -> ModelArch:
    """`arch` with generation_config.json's eos ids added to config.json's: an instruct model's
    end of turn is often listed there only (Gemma 2's <end_of_turn>, Phi-3's <|end|>, the first
    Llama 3 Instruct's <|eot_id|>), and transformers' generate and vLLM stop at it."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return arch
    try:
        cfg = json.loads(path.read_text())
        ids = _eos_ids(cfg.get("eos_token_id") if isinstance(cfg, dict) else None)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"{path}: eos_token_id must be a token id or a list of them, and "
                             f"the file valid JSON ({exc})") from None
    extra = tuple(dict.fromkeys(i for i in ids if i not in arch.eos_token_ids))
    return dataclasses.replace(arch, eos_token_ids=arch.eos_token_ids + extra) if extra else arch


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: no config.json; a model directory needs config.json, "
                             "*.safetensors weights and tokenizer files")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    return cfg


def read_arch(model_dir: Path) -> ModelArch:
    return arch_from_dict(read_config(model_dir), str(Path(model_dir) / "config.json"))


def foreign_model(model_dir: Path, overrides: Optional[dict] = None
                  ) -> Optional[tuple[Optional[int], Optional[int]]]:
    """None where the engine runs config.json's model_type; else (vocab size, context length) as
    the config states them (or its text_config): what a job through an external engine (strategy
    vllm, the route for the other architectures) checks its prompts against."""
    cfg = {**read_config(model_dir), **(overrides or {})}
    if cfg.get("model_type") in FAMILIES or cfg.get("model_type") in LANGUAGE_MODELS:
        return None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}

    def first(*keys) -> Optional[int]:
        found = [c.get(k) for c in (cfg, text) for k in keys]
        return next((int(v) for v in found if isinstance(v, int) and v > 0), None)

    return (first("vocab_size"),
            first("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"))
