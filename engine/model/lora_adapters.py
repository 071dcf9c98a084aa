"""PEFT LoRA adapters on disk: `model.lora_modules` resolved, each directory checked and read.

A PEFT adapter directory holds adapter_config.json (r, lora_alpha, use_rslora, target_modules,
bias, ...) and adapter_model.safetensors (else adapter_model.bin or .pt, torch's pickle, which
vLLM reads too: loaded with weights_only=True), whose tensors are named after the base model's
modules: `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). The engine applies adapters to the decoder layers' linears: q/k/v (onto its fused
qkv_proj), o_proj, gate/up (onto gate_up_proj), down_proj, and the fused qkv_proj /
gate_up_proj a Phi-3 checkpoint has. Anything else an adapter targets (embed_tokens, lm_head, a
mixture of experts' experts), DoRA, LoRA biases and modules_to_save is refused at start with the
path and what is wrong; per-module rank_pattern / alpha_pattern scale each module as peft does. Only local directories are read.

Slot numbers: adapter i of model.lora_modules (in the recipe's order) is slot i + 1; slot 0 is
the base model (no adapter).
"""
from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ..errors import ConfigError
from .arch import ModelArch

if TYPE_CHECKING:       # torch-free: the vllm strategy checks adapter configs at validation
    import torch

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# the weights files read, in vLLM's order of preference (vllm/lora/lora_model.py)
WEIGHTS_FILES = (WEIGHTS_FILE, "adapter_model.bin", "adapter_model.pt")
# the decoder layer's modules an adapter may target (the HF names, inside a layer)
COLUMN_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.qkv_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj")
ROW_MODULES = ("self_attn.o_proj", "mlp.down_proj")
SUPPORTED = COLUMN_MODULES + ROW_MODULES
_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class LoraSpec:
    """model.lora_modules resolved: (name, directory) in slot order (slot = index + 1) and
    model.max_lora_rank. Plain data: it travels to the worker processes."""

    modules: tuple[tuple[str, str], ...]
    max_rank: int = 16

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.modules]


def lora_spec(model_cfg) -> Optional[LoraSpec]:
    """The recipe's adapters (a ModelConfig), or None where it names none."""
    modules = getattr(model_cfg, "lora_modules", None)
    if not modules:
        return None
    return LoraSpec(tuple((name, str(Path(path).expanduser())) for name, path in modules.items()),
                    model_cfg.max_lora_rank)


@dataclass
class Adapter:
    """One adapter's tensors: (layer, HF module) -> (A [r, in], B [out, r]) and its scaling;
    targets: the HF modules (inside a layer) it has tensors for, in any layer, loaded or not."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    targets: frozenset[str] = frozenset()


def _where(name: str, path: str) -> str:
    return f"model.lora_modules.{name}: {path}"


def read_adapter_config(name: str, path: str, max_rank: int) -> tuple[int, float]:
    """-> (rank, scaling) from adapter_config.json; ConfigError naming the path and the key."""
    return _rank_and_scaling(_adapter_config(name, path, max_rank))


def _rank_and_scaling(cfg: dict) -> tuple[int, float]:
    """The adapter's rank and scaling (modules without a rank / alpha pattern of their own)."""
    return cfg["r"], _scaling(cfg, cfg["r"], cfg.get("lora_alpha", cfg["r"]))


def _scaling(cfg: dict, rank: int, alpha: float) -> float:
    return float(alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank)


def module_scaling(cfg: dict, module: str) -> float:
    """The scaling peft (and vLLM 0.32's PEFTHelper.get_rank_and_scaling) gives `module` (the
    tensor name less `base_model.model.`, e.g. model.layers.3.self_attn.q_proj): rank_pattern
    and alpha_pattern keys match a suffix of it at a "." boundary, as regexes; the first wins."""
    def matched(pattern: dict, default):
        for key, value in (pattern or {}).items():
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return default

    return _scaling(cfg, matched(cfg.get("rank_pattern"), cfg["r"]),
                    matched(cfg.get("alpha_pattern"), cfg.get("lora_alpha", cfg["r"])))


def _adapter_config(name: str, path: str, max_rank: int) -> dict:
    """adapter_config.json, checked; ConfigError naming the path and the key."""
    where, folder = _where(name, path), Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{where}: not a directory (a PEFT LoRA adapter directory holding "
                          f"{CONFIG_FILE} and {WEIGHTS_FILE}; only local paths are read)")
    if not (folder / CONFIG_FILE).is_file():
        raise ConfigError(f"{where}: {CONFIG_FILE} is missing")
    weights_file(name, path)
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}/{CONFIG_FILE}: not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}/{CONFIG_FILE}: not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ConfigError(f"{where}: peft_type {cfg.get('peft_type')!r}; only LoRA adapters "
                          "(peft_type LORA) are applied")
    refusals = [("use_dora", "DoRA (use_dora: true)"), ("lora_bias", "LoRA biases (lora_bias: "
                "true)"), ("modules_to_save", "modules_to_save (whole modules trained beside the "
                "adapter)"),
                ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)"),
                ("layer_replication", "layer_replication"),
                ("target_parameters", "target_parameters (LoRA on parameters, e.g. experts)"),
                ("trainable_token_indices", "trainable_token_indices")]
    for key, what in refusals:
        if cfg.get(key):
            raise ConfigError(f"{where}: {what} is not supported; adapters with plain LoRA on "
                              f"{', '.join(m.split('.')[1] for m in SUPPORTED)} are")
    if cfg.get("bias", "none") != "none":
        raise ConfigError(f"{where}: bias {cfg.get('bias')!r} is not supported (only \"none\")")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"{where}/{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ConfigError(f"{where}/{CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_rank:
        raise ConfigError(f"{where}: rank {rank} is above model.max_lora_rank ({max_rank}); "
                          f"raise model.max_lora_rank to at least {rank}")
    # fan_in_fan_out concerns the base weight's layout (GPT-2's Conv1D); lora_A / lora_B are
    # stored as Linear weights either way, so it changes nothing here
    for key, kind in (("rank_pattern", int), ("alpha_pattern", (int, float))):
        pattern = cfg.get(key) or {}
        bad = [f"{k}: {v!r}" for k, v in pattern.items() if isinstance(v, bool)
               or not isinstance(v, kind) or v <= 0] if isinstance(pattern, dict) else [pattern]
        if bad:
            raise ConfigError(f"{where}/{CONFIG_FILE}: {key} must map module names to positive "
                              f"{'integers' if kind is int else 'numbers'} (got {bad[0]})")
        for pattern_key in pattern:
            try:
                re.compile(pattern_key)
            except re.error as exc:
                raise ConfigError(f"{where}/{CONFIG_FILE}: {key} key {pattern_key!r} is not a "
                                  f"regular expression ({exc})") from None
    return cfg


def _expected_shape(arch: ModelArch, module: str, kind: str, rank: int) -> tuple[int, int]:
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    in_features, out_features = {
        "self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
        "self_attn.qkv_proj": (h, q + 2 * kv), "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
        "mlp.gate_up_proj": (h, 2 * inter), "mlp.down_proj": (inter, h)}[module]
    return (rank, in_features) if kind == "A" else (out_features, rank)


def _module_of(key: str, arch: ModelArch, where: str) -> tuple[int, str, str]:
    """A tensor name -> (layer, HF module inside the layer, "A" | "B"); ConfigError for
    anything the engine cannot apply."""
    supported = ", ".join(m.split(".")[1] for m in SUPPORTED)
    match = _KEY.match(key)
    if match is None:
        raise ConfigError(f"{where}: tensor {key!r} is not a LoRA A/B weight (lora_embedding, "
                          f"DoRA magnitudes and other kinds are not supported; LoRA on "
                          f"{supported} is)")
    inner, kind = match.groups()
    layer = _LAYER.match(inner)
    if layer is None or layer.group(2) not in SUPPORTED:
        module = inner if layer is None else layer.group(2)
        raise ConfigError(f"{where}: the adapter targets {module!r}, which the engine cannot "
                          f"apply LoRA to (embed_tokens and lm_head are not supported); it applies "
                          f"LoRA to the decoder layers' {supported}")
    index, module = int(layer.group(1)), layer.group(2)
    if module.startswith("mlp.") and arch.is_sparse(index):
        raise ConfigError(f"{where}: the adapter targets {module} of layer {index}, a mixture of "
                          "experts' layer: LoRA on experts is not supported (attention only)")
    if index >= max(arch.num_layers, arch.checkpoint_layers or 0):
        raise ConfigError(f"{where}: tensor {key!r} is for layer {index}; the model has "
                          f"{arch.num_layers} layers (is it an adapter of another model?)")
    return index, module, kind


def weights_file(name: str, path: str) -> Path:
    """The adapter's weights file: the first of WEIGHTS_FILES the directory holds."""
    for file_name in WEIGHTS_FILES:
        if (Path(path) / file_name).is_file():
            return Path(path) / file_name
    raise ConfigError(f"{_where(name, path)}: no weights file ({', '.join(WEIGHTS_FILES)}: "
                      "none is there)")


def _pickled_tensors(file: Path, where: str) -> dict:
    """adapter_model.bin / .pt: torch.save's dict of tensors, unpickled with weights_only."""
    import pickle

    import torch

    try:
        tensors = torch.load(file, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise ConfigError(f"{where}/{file.name}: cannot read ({exc})") from None
    if not isinstance(tensors, dict) or not all(
            isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ConfigError(f"{where}/{file.name}: not a dict of tensors (torch.save of a PEFT "
                          "adapter's state dict)")
    return tensors


@contextmanager
def _tensor_file(file: Path, where: str):
    """-> (names, the shape of a name, the tensor of a name) of a safetensors file (its header
    alone until a tensor is asked for) or of a torch pickle (loaded whole: adapters are small)."""
    if file.name != WEIGHTS_FILE:
        tensors = _pickled_tensors(file, where)
        yield list(tensors), (lambda key: tuple(tensors[key].shape)), tensors.__getitem__
        return
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as fh:
        yield list(fh.keys()), (lambda key: tuple(fh.get_slice(key).get_shape())), fh.get_tensor


def read_adapter(name: str, path: str, arch: ModelArch, max_rank: int,
                 layers: Optional[range] = None) -> Adapter:
    """The adapter's config checked and its tensors read (only `layers`' where given; with
    layers = range(0) only the file's header: a check that loads nothing). Every tensor's name
    and shape is checked against the model's config first. ConfigError names the path."""
    from safetensors import SafetensorError

    cfg = _adapter_config(name, path, max_rank)
    rank, scaling = _rank_and_scaling(cfg)
    where, file = _where(name, path), weights_file(name, path)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with _tensor_file(file, where) as (keys, shape_of, tensor_of):
            for key in keys:
                layer, module, kind = _module_of(key, arch, where)
                shape = shape_of(key)
                if len(shape) != 2 or shape[1 - (kind == "A")] > max_rank:
                    raise ConfigError(f"{where}: tensor {key!r} has shape {shape}: a rank above "
                                      f"model.max_lora_rank ({max_rank})")
                expected = _expected_shape(arch, module, kind, shape[0 if kind == "A" else 1])
                if shape != expected:
                    raise ConfigError(f"{where}: tensor {key!r} has shape {shape}, the model's "
                                      f"config implies {expected} (an adapter of another model?)")
                halves.setdefault((layer, module), {})[kind] = None
                if layer < arch.num_layers and (layers is None or layer in layers):
                    halves[(layer, module)][kind] = tensor_of(key)
    except SafetensorError as exc:
        raise ConfigError(f"{where}/{file.name}: cannot read ({exc})") from None
    if not keys:
        raise ConfigError(f"{where}/{file.name}: holds no tensors")
    weights = {}
    for (layer, module), pair in halves.items():
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise ConfigError(f"{where}: layer {layer} {module} has no lora_{missing} weight")
        if pair["A"] is not None and pair["B"] is not None:
            if pair["A"].shape[0] != pair["B"].shape[1]:
                raise ConfigError(f"{where}: layer {layer} {module}: lora_A's rank "
                                  f"{pair['A'].shape[0]} differs from lora_B's "
                                  f"{pair['B'].shape[1]}")
            # rank_pattern / alpha_pattern: the module's own scaling, folded into its B
            ratio = module_scaling(cfg, f"model.layers.{layer}.{module}") / scaling
            weights[(layer, module)] = (pair["A"], pair["B"] if ratio == 1 else pair["B"] * ratio)
    return Adapter(name, path, rank, scaling, weights,
                   frozenset(module for _, module in halves))


def check_adapters(spec: Optional[LoraSpec], arch: ModelArch) -> None:
    """Every adapter's config and tensor names / shapes against the model, nothing loaded
    (the build, `batchinfer validate` and `run --dry-run`)."""
    for name, path in spec.modules if spec is not None else ():
        read_adapter(name, path, arch, spec.max_rank, layers=range(0))


def checked_lora(model_cfg, arch: ModelArch) -> Optional[LoraSpec]:
    """The recipe's adapters (lora_spec), each checked against the model (check_adapters)."""
    spec = lora_spec(model_cfg)
    check_adapters(spec, arch)
    return spec


def lora_info(model_cfg) -> dict:
    """The engine info's LoRA keys (report.json's engine): the adapters' names in slot order
    (the engine maps a request's `lora` with them), their directories and the rank limit; {}
    without adapters."""
    spec = lora_spec(model_cfg)
    if spec is None:
        return {}
    return {"lora_modules": spec.names, "lora_paths": dict(spec.modules),
            "max_lora_rank": spec.max_rank}
