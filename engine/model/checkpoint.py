"""What a model's checkpoint holds: every Hugging Face tensor name and shape its config.json
implies (per family), and the errors a checkpoint that does not match gives: a missing tensor,
one the model has no place for, one of the wrong shape, each named with both shapes."""
from __future__ import annotations

import re
from typing import Iterable, Iterator, Optional

from ..errors import ModelLoadError
from .arch import ModelArch
from .moe import moe_tensor_shapes
from .registry import family_module

# tensors some checkpoints carry that are not weights (old Llama exports saved RoPE's buffer)
_NOT_WEIGHTS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def hf_tensor_shapes(arch: ModelArch,
                     quantized: bool = True) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The full model's Hugging Face tensor names and shapes (what a checkpoint would hold);
    `quantized` false: the de-quantized form of a quantized checkpoint's tensors (dummy weights
    are drawn in it)."""
    h, v, inter = arch.hidden_size, arch.vocab_size, arch.intermediate_size
    q, kv = arch.q_size, arch.kv_size
    norms = family_module(arch.model_type).DecoderLayer.NORMS
    yield "model.embed_tokens.weight", (v, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        for name in norms:
            yield f"{p}{name}.weight", (h,)
        if arch.fused_checkpoint:
            yield p + "self_attn.qkv_proj.weight", (q + 2 * kv, h)
        else:
            for proj, rows in (("q", q), ("k", kv), ("v", kv)):
                yield f"{p}self_attn.{proj}_proj.weight", (rows, h)
                if arch.qkv_bias:
                    yield f"{p}self_attn.{proj}_proj.bias", (rows,)
        if arch.qk_norm is not None:
            whole = arch.qk_norm == "full"
            yield p + "self_attn.q_norm.weight", (q if whole else arch.head_dim,)
            yield p + "self_attn.k_norm.weight", (kv if whole else arch.head_dim,)
        yield p + "self_attn.o_proj.weight", (h, q)
        if arch.o_bias:
            yield p + "self_attn.o_proj.bias", (h,)
        if arch.attention_sinks:
            yield p + "self_attn.sinks", (arch.num_heads,)
        if arch.is_sparse(i):
            yield from moe_tensor_shapes(arch, p, quantized)
            continue
        if arch.fused_checkpoint:
            yield p + "mlp.gate_up_proj.weight", (2 * inter, h)
        else:
            yield p + "mlp.gate_proj.weight", (inter, h)
            yield p + "mlp.up_proj.weight", (inter, h)
        yield p + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    if not arch.tie_word_embeddings:
        yield "lm_head.weight", (v, h)


class CheckpointCheck:
    """Checks a checkpoint's tensors against the config as they are read: `see` each tensor's
    name and shape (from the file's header), then `finish` with the names the partition needs."""

    def __init__(self, arch: ModelArch, source: str):
        self.arch, self.source = arch, source
        self.expected = dict(hf_tensor_shapes(arch))
        self.seen: set[str] = set()

    def model_name(self, name: str) -> Optional[str]:
        """The language model's name of a checkpoint tensor: the name itself, or without the
        language model's prefix in a vision-language checkpoint (None: a vision tensor)."""
        prefix = self.arch.checkpoint_prefix
        if not prefix:
            return name
        return name[len(prefix):] if name.startswith(prefix) else None

    def see(self, name: str, shape: Iterable[int]) -> bool:
        """False for a tensor that is not a weight (skip it); raises for one the config has no
        place for or gives another shape. `name` is the model's (model_name)."""
        shape = tuple(int(s) for s in shape)
        if _NOT_WEIGHTS.search(name) or (name == "lm_head.weight" and self.arch.tie_word_embeddings):
            return False
        layer = _LAYER.match(name)
        if layer and self.arch.num_layers <= int(layer.group(1)) < (self.arch.checkpoint_layers or 0):
            return False                  # a layer hf_overrides left out
        expected = self.expected.get(name)
        if expected is None:
            raise ModelLoadError(
                f"{self.source}: the checkpoint has a tensor {name!r} of shape {shape} that a "
                f"{self.arch.model_type} model with this config.json does not have; the config and "
                "the weights are from different models, or the config is missing a field")
        if shape != expected:
            raise ModelLoadError(f"{self.source}: tensor {name!r} has shape {shape} in the "
                                 f"checkpoint, but config.json implies {expected}")
        self.seen.add(name)
        return True

    def finish(self, needed: Iterable[str]) -> None:
        """Raises naming the tensors of `needed` (this partition's) that no file held."""
        missing = [n for n in needed if n not in self.seen]
        if missing:
            listed = ", ".join(f"{n!r} {self.expected[n]}" for n in missing[:6])
            raise ModelLoadError(f"{self.source}: the checkpoint is missing {len(missing)} "
                                 f"tensor(s) that config.json implies (name and shape): {listed}"
                                 f"{' ...' if len(missing) > 6 else ''}")
