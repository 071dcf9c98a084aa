"""Builds a CausalLM partition and fills it from safetensors (or random weights for `dummy`).

Hugging Face tensor names are mapped onto the fused layout: q/k/v rows go into qkv_proj, gate/up
rows into gate_up_proj. Only the tensors this partition needs are read.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Iterator, Optional

import torch

from ..errors import ModelLoadError
from .arch import ModelArch, arch_from_dict, read_arch
from .fast_linear import pack_linears
from .llama import CausalLM, ModelPartition

log = logging.getLogger(__name__)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def safetensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"{index}: malformed index ({exc})") from None
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files (only safetensors are loaded; "
                             "convert .bin checkpoints or pass a .gguf file)")
    return files


def _iter_tensors(files: list[Path], wanted) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():
                    if wanted(name):
                        yield name, fh.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot read weights ({exc}); the file may be corrupt "
                                 "or truncated") from None


class _Filler:
    """Copies HF tensors into the fused parameters and tracks which rows got filled."""

    def __init__(self, model: CausalLM):
        self.model, self.arch = model, model.arch
        self.params = dict(model.named_parameters())
        self.filled: dict[str, int] = {}

    def target(self, name: str) -> Optional[tuple[str, int, int]]:
        """HF name -> (our parameter, first row, row count) or None if not ours to hold."""
        a, m = self.arch, self.model
        if name == "model.embed_tokens.weight":
            return ("embed_tokens.weight", 0, a.vocab_size) if m.embed_tokens is not None else None
        if name == "model.norm.weight":
            return ("norm.weight", 0, a.hidden_size) if m.norm is not None else None
        if name == "lm_head.weight":
            tied = a.tie_word_embeddings
            return ("lm_head.weight", 0, a.vocab_size) if m.lm_head is not None and not tied else None
        match = _LAYER.match(name)
        if not match:
            return None
        layer = int(match.group(1)) - m.partition.layer_start
        if not 0 <= layer < len(m.layers):
            return None
        rest, p = match.group(2), f"layers.{layer}."
        q, kv, inter = a.q_size, a.kv_size, a.intermediate_size
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
            "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
        }
        module, _, kind = rest.rpartition(".")
        if module in fused:
            target, start, rows = fused[module]
            return f"{p}{target}.{kind}", start, rows
        return f"{p}{rest}", 0, None

    def put(self, name: str, tensor: torch.Tensor) -> None:
        where = self.target(name)
        if where is None:
            return
        pname, start, rows = where
        param = self.params.get(pname)
        if param is None:
            raise ModelLoadError(f"weight {name!r} maps to unknown parameter {pname!r}")
        rows = param.shape[0] if rows is None else rows
        dest = param.data[start:start + rows]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, the config "
                                 f"implies {tuple(dest.shape)}")
        dest.copy_(tensor)
        self.filled[pname] = self.filled.get(pname, 0) + rows

    def check_complete(self, source: str) -> None:
        missing = [n for n, p in self.params.items() if self.filled.get(n, 0) != p.shape[0]]
        if missing:
            raise ModelLoadError(f"{source}: weights missing for {', '.join(missing[:6])}"
                                 f"{' ...' if len(missing) > 6 else ''}")


def _dummy_init(model: CausalLM, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)


def build_model(model_dir: Path, arch: ModelArch, dtype: torch.dtype, device: torch.device,
                max_positions: int, partition: ModelPartition = ModelPartition(),
                dummy: bool = False, seed: int = 0) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(arch, max_positions, partition)
    model = model.to_empty(device="cpu").to(torch.float32)
    model.tie_weights()
    model.rotary.reset()
    with torch.no_grad():
        if dummy:
            _dummy_init(model, seed)
        else:
            filler = _Filler(model)
            files = safetensor_files(model_dir)
            for name, tensor in _iter_tensors(files, lambda n: filler.target(n) is not None):
                filler.put(name, tensor)
            filler.check_complete(str(model_dir))
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    pack_linears(model)
    return model


def load_arch(model_dir: Path, overrides: Optional[dict] = None) -> ModelArch:
    if not overrides:
        return read_arch(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(overrides)
    return arch_from_dict(cfg, f"{model_dir / 'config.json'} with hf_overrides")
