"""Builds a CausalLM partition and fills it from safetensors (or random weights for `dummy`).

Hugging Face tensor names are mapped onto the fused layout: q/k/v rows go into qkv_proj, gate/up
rows into gate_up_proj (a checkpoint that stores them fused, Phi-3's, has that layout already);
GPT-OSS's experts, stored stacked per layer (gate and up interleaved) or in MXFP4, are converted
into the same expert stacks (`_Filler.convert`).
Only the tensors this partition needs are read, and a tensor-parallel rank reads only its slices
of them (shard.py says which). Every tensor's name and shape is checked against the config first
(checkpoint.py). Dummy weights are generated as whole HF tensors from (seed, name) and go through
the same slicing, so every layout gets the same model.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..cpu_dtype import activation_dtype
from ..errors import ModelLoadError
from .arch import ModelArch, arch_from_dict, read_arch, with_generation_eos
from .causal_lm import CausalLM, ModelPartition
from .checkpoint import CheckpointCheck, hf_tensor_shapes
from .fast_linear import pack_linears
from .fused_experts import pack_experts
from .rope import Rotary
from .shard import TensorParallelGroup

log = logging.getLogger(__name__)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^experts\.(\d+)\.(\w+)\.weight$")


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


@dataclass(frozen=True)
class _Target:
    """Where one HF tensor (or a piece of it) goes: rows [start, start + rows) of our parameter
    `param`, taking the source slice [lo, hi) along `dim` (None: the whole tensor) of a tensor
    `full` wide there. `zero`: the rows are zeros whatever the source holds (a row-parallel bias
    on every TP rank but the first, so that the all-reduce adds it once). `expert`: the rows are
    within that expert's slab of a stacked [experts, rows, cols] parameter."""

    param: str
    start: int = 0
    rows: Optional[int] = None
    dim: Optional[int] = None
    lo: int = 0
    hi: int = 0
    full: int = 0
    zero: bool = False
    expert: Optional[int] = None
    # a layout change after the slice (GPT-OSS's stacked experts, _Filler.convert): "gate_up_t",
    # "gate_up_bias", "down_t"; or "mxfp4_blocks" / "mxfp4_scales" (_Filler.put_mxfp4; `part`:
    # the de-quantized columns before this rank's first, and its rows)
    convert: Optional[str] = None
    part: tuple[int, int] = (0, 0)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.dim is None else tensor.narrow(self.dim, self.lo, self.hi - self.lo)


class _Filler:
    """Copies HF tensors (or this rank's slices of them) into the fused parameters and tracks
    which rows got filled."""

    def __init__(self, model: CausalLM):
        self.model, self.arch, self.shard = model, model.arch, model.shard
        self.params = dict(model.named_parameters())
        self.filled: dict[str, int] = {}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}   # MXFP4 halves awaiting the other

    def targets(self, name: str) -> list[_Target]:
        """HF name -> where its pieces go; [] if not ours to hold."""
        a, m, sh = self.arch, self.model, self.shard
        split = sh.tp_size > 1
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            ours = "embed_tokens" if name.startswith("model.") else "lm_head"
            if getattr(m, ours) is None or (ours == "lm_head" and a.tie_word_embeddings):
                return []
            return [_Target(f"{ours}.weight", 0, sh.vocab_rows,
                            *self._cut(split, 0, sh.vocab_start, sh.vocab_rows, a.vocab_size))]
        if name == "model.norm.weight":
            return [_Target("norm.weight")] if m.norm is not None else []
        match = _LAYER.match(name)
        if not match:
            return []
        layer = int(match.group(1)) - m.partition.layer_start
        if not 0 <= layer < len(m.layers):
            return []
        rest, p = match.group(2), f"layers.{layer}."
        if rest == "self_attn.sinks":    # one per head: this rank's heads
            return [_Target(f"{p}{rest}", 0, None,
                            *self._cut(split, 0, sh.q_start // sh.head_dim, sh.num_heads,
                                       a.num_heads))]
        moe = a.moe
        if a.is_sparse(int(match.group(1))) and rest.startswith(moe.block_name + "."):
            return self._moe_targets(p + "mlp.", rest[len(moe.block_name) + 1:])
        module, _, kind = rest.rpartition(".")
        pieces = self._column_pieces(module)
        if pieces is not None:   # column-parallel: this rank's output rows, into a fused parameter
            target, parts = pieces
            if not split and len(parts) > 1:     # a fused checkpoint tensor, whole: our layout
                return [_Target(f"{p}{target}.{kind}")]
            return [_Target(f"{p}{target}.{kind}", start, rows, *self._cut(split, 0, lo, rows, full))
                    for start, rows, lo, full in parts]
        row = {  # row-parallel: this rank's input columns
            "self_attn.o_proj": (sh.q_start, sh.q_size, a.q_size),
            "mlp.down_proj": (sh.intermediate_start, sh.intermediate_size, a.intermediate_size),
        }
        if module in row and kind == "weight":
            lo, cols, full = row[module]
            return [_Target(f"{p}{rest}", 0, None, *self._cut(split, 1, lo, cols, full))]
        if module in row:        # its bias: added once, by the first rank
            return [_Target(f"{p}{rest}", zero=sh.tp_rank > 0)]
        return [_Target(f"{p}{rest}")]

    def _moe_targets(self, p: str, rest: str) -> list[_Target]:
        """A sparse layer's feed-forward tensor (`rest`: its name inside the checkpoint's block)
        -> our SparseMoE's parameters (prefix `p`): an expert's gate and up rows into its slab of
        experts.gate_up, its down columns into experts.down, this rank's intermediate rows of
        each; the shared expert as a dense MLP of its own size; the router and the shared
        expert's gate whole on every rank."""
        moe, sh = self.arch.moe, self.shard
        split = sh.tp_size > 1
        if moe.stacked_checkpoint and rest.startswith("experts."):
            return [self._stacked_target(f"{p}experts.", rest[len("experts."):])]
        expert = _EXPERT.match(rest)
        if expert is not None:
            index, proj = int(expert.group(1)), expert.group(2)
            gate, _, down = moe.projections
            return [self._feed_forward_part(
                proj == gate, proj == down, f"{p}experts.gate_up", f"{p}experts.down",
                sh.expert_intermediate_size, sh.expert_intermediate_start,
                moe.intermediate_size, split, expert=index)]
        if rest.startswith("shared_expert."):
            proj = rest[len("shared_expert."):].partition(".")[0]
            return [self._feed_forward_part(
                proj == "gate_proj", proj == "down_proj",
                f"{p}shared_expert.gate_up_proj.weight", f"{p}{rest}",
                sh.shared_intermediate_size, sh.shared_intermediate_start,
                moe.shared_intermediate_size, split)]
        return [_Target(f"{p}{rest}")]

    def _stacked_target(self, p: str, name: str) -> _Target:
        """GPT-OSS's stacked experts (moe._stacked_tensor_shapes) -> our experts' stacks, this
        rank's intermediate rows of each: gate/up [E, H, 2 I] keeps columns [2 lo, 2 hi) (gate
        and up interleaved, so a rank's rows are contiguous there), transposed and split into
        gate rows then up rows; down [E, I, H] rows [lo, hi), transposed; the down bias added
        once (rank 0); of an MXFP4 pair, the rank's share of the blocks and of the scales
        (gpt_oss.mxfp4_span), de-quantized when both are in (put_mxfp4)."""
        sh, moe = self.shard, self.arch.moe
        split = sh.tp_size > 1
        lo, rows = sh.expert_intermediate_start, sh.expert_intermediate_size
        full = moe.intermediate_size
        if name == "gate_up_proj":
            return _Target(p + "gate_up", 0, None, *self._cut(split, 2, 2 * lo, 2 * rows, 2 * full),
                           convert="gate_up_t")
        if name == "gate_up_proj_bias":
            return _Target(p + "gate_up_bias", 0, None,
                           *self._cut(split, 1, 2 * lo, 2 * rows, 2 * full), convert="gate_up_bias")
        if name == "down_proj":
            return _Target(p + "down", 0, None, *self._cut(split, 1, lo, rows, full),
                           convert="down_t")
        if name == "down_proj_bias":
            return _Target(p + "down_bias", zero=sh.tp_rank > 0)
        proj, _, kind = name.rpartition("_")          # gate_up_proj / down_proj, blocks / scales
        if kind in ("blocks", "scales") and proj in ("gate_up_proj", "down_proj"):
            from .gpt_oss import MXFP4_GROUP, mxfp4_span

            gate_up = proj == "gate_up_proj"
            dim, first, end, skip = mxfp4_span(gate_up, lo, rows)
            width = 2 * full if gate_up else full // MXFP4_GROUP
            return _Target(p + ("gate_up" if gate_up else "down"), 0, None,
                           *self._cut(split, dim, first, end - first, width),
                           convert=f"mxfp4_{kind}", part=(skip, rows))
        return _Target(p + name)                      # no such parameter: put() names it

    @staticmethod
    def convert(tensor: torch.Tensor, where: _Target) -> torch.Tensor:
        """`tensor` (this rank's slice of a stacked dense expert tensor) in our layout."""
        from .gpt_oss import deinterleave

        if where.convert == "gate_up_t":
            return deinterleave(tensor.transpose(1, 2))
        if where.convert == "gate_up_bias":
            return deinterleave(tensor)
        return tensor.transpose(1, 2)                 # down_t

    def put_mxfp4(self, name: str, tensor: torch.Tensor, where: _Target) -> None:
        """One half of an MXFP4 pair (this rank's share of the blocks or the scales); with both
        in, de-quantized straight into the parameter a chunk of experts at a time: gate/up's
        interleaved rows split into gate rows then up rows, down's columns from `where.part`."""
        from .gpt_oss import deinterleave, dequantize_experts

        halves = self.pending.setdefault(where.param, {})
        halves[where.convert] = tensor
        if len(halves) < 2:
            return
        del self.pending[where.param]
        skip, rows = where.part
        if where.param.endswith("gate_up"):           # [E, 2 I, H], gate and up interleaved
            layout = deinterleave
        else:                                         # [E, H, I]
            def layout(dense: torch.Tensor) -> torch.Tensor:
                return dense[:, :, skip:skip + rows]
        param = self.params[where.param].data
        try:
            dequantize_experts(halves["mxfp4_blocks"], halves["mxfp4_scales"], param, layout)
        except ValueError as exc:
            raise ModelLoadError(f"weight {name!r}: {exc}") from None
        slabs = param.shape[0] * param.shape[1]                # every expert's rows
        self.filled[where.param] = self.filled.get(where.param, 0) + slabs

    def _feed_forward_part(self, is_gate: bool, is_down: bool, gate_up: str, down: str,
                           rows: int, lo: int, full: int, split: bool,
                           expert: Optional[int] = None) -> _Target:
        """An expert's (or the shared expert's) projection: gate rows, then up rows, of this
        rank's intermediate slice into the fused `gate_up`; down's matching columns into `down`."""
        if is_down:
            return _Target(down, 0, None, *self._cut(split, 1, lo, rows, full), expert=expert)
        return _Target(gate_up, 0 if is_gate else rows, rows,
                       *self._cut(split, 0, lo, rows, full), expert=expert)

    def _column_pieces(self, module: str) -> Optional[tuple[str, list[tuple[int, int, int, int]]]]:
        """Our fused parameter for a column-parallel HF module and its pieces as (our first row,
        rows, first row in the HF tensor, the HF tensor's rows); None for other modules. The
        fused HF tensors (Phi-3's) have one piece per projection they hold."""
        a, sh = self.arch, self.shard
        q, kv, inter = sh.q_size, sh.kv_size, sh.intermediate_size
        i_start, i_full = sh.intermediate_start, a.intermediate_size
        qkv_full = a.q_size + 2 * a.kv_size
        pieces = {
            "self_attn.q_proj": ("self_attn.qkv_proj", [(0, q, sh.q_start, a.q_size)]),
            "self_attn.k_proj": ("self_attn.qkv_proj", [(q, kv, sh.kv_start, a.kv_size)]),
            "self_attn.v_proj": ("self_attn.qkv_proj", [(q + kv, kv, sh.kv_start, a.kv_size)]),
            "mlp.gate_proj": ("mlp.gate_up_proj", [(0, inter, i_start, i_full)]),
            "mlp.up_proj": ("mlp.gate_up_proj", [(inter, inter, i_start, i_full)]),
            "self_attn.qkv_proj": ("self_attn.qkv_proj", [
                (0, q, sh.q_start, qkv_full),
                (q, kv, a.q_size + sh.kv_start, qkv_full),
                (q + kv, kv, a.q_size + a.kv_size + sh.kv_start, qkv_full)]),
            "mlp.gate_up_proj": ("mlp.gate_up_proj", [
                (0, inter, i_start, 2 * i_full), (inter, inter, i_full + i_start, 2 * i_full)]),
        }
        return pieces.get(module)

    @staticmethod
    def _cut(split: bool, dim: int, lo: int, size: int, full: int) -> tuple:
        """(dim, lo, hi, full) of a sliced source, or no slice when this rank holds all of it."""
        return (dim, lo, lo + size, full) if split else (None, 0, 0, 0)

    def check_source_shape(self, name: str, shape, where: _Target) -> None:
        """A sliced tensor is checked whole, so a wrong width is not hidden by the slice."""
        if where.dim is not None and (len(shape) <= where.dim or shape[where.dim] != where.full):
            raise ModelLoadError(f"weight {name!r} has shape {tuple(shape)}, the config implies "
                                 f"{where.full} along dim {where.dim}")

    def put(self, name: str, tensor: torch.Tensor, where: _Target, stored: bool = False) -> None:
        """`tensor` is what `where` selects: this rank's slice when `where.dim` is set. A norm's
        weight gets the family's offset added (Gemma's 1 + w), unless `stored`: the tensor is a
        parameter's value already (a norm another partition of this model held)."""
        param = self.params.get(where.param)
        if param is None:
            raise ModelLoadError(f"weight {name!r} maps to unknown parameter {where.param!r}")
        if where.convert is not None and where.convert.startswith("mxfp4_"):
            self.put_mxfp4(name, tensor, where)
            return
        if where.convert is not None:
            tensor = self.convert(tensor, where)
        data = param.data if where.expert is None else param.data[where.expert]
        rows = data.shape[0] if where.rows is None else where.rows
        dest = data[where.start:where.start + rows]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, the config "
                                 f"implies {tuple(dest.shape)}")
        if where.zero:
            dest.zero_()
        elif self.arch.norm_offset and not stored and where.param.endswith("norm.weight"):
            dest.copy_(tensor.float() + self.arch.norm_offset)
        else:
            dest.copy_(tensor)
        filled = rows if dest.dim() < 2 else dest.numel() // dest.shape[-1]
        self.filled[where.param] = self.filled.get(where.param, 0) + filled

    def expected_rows(self, pname: str) -> int:
        if pname in ("embed_tokens.weight", "lm_head.weight"):
            return self.shard.vocab_rows  # the rest is padding
        shape = self.params[pname].shape
        return shape[0] * shape[1] if len(shape) == 3 else shape[0]   # stacked experts: per slab

    def check_complete(self, source: str) -> None:
        """Every parameter row filled (the checkpoint check names missing tensors before this)."""
        missing = [n for n in self.params if self.filled.get(n, 0) != self.expected_rows(n)]
        if missing:
            raise ModelLoadError(f"{source}: weights missing for {', '.join(missing[:6])}"
                                 f"{' ...' if len(missing) > 6 else ''}")


def _read_weights(files: list[Path], filler, arch: ModelArch, source: str) -> None:
    """Reads only what this partition holds; a TP rank reads only its slices (get_slice). Every
    tensor's name and shape is checked against the config (from the file's header) first.
    `filler` is a _Filler, or anything with its targets / check_source_shape / put."""
    from safetensors import SafetensorError, safe_open

    check = CheckpointCheck(arch, source)
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as fh:
                for stored in fh.keys():
                    name = check.model_name(stored)
                    part = fh.get_slice(stored)
                    if name is None or not check.see(name, part.get_shape()):
                        continue
                    for where in filler.targets(name):
                        if where.dim is None:
                            tensor = fh.get_tensor(stored)
                        else:
                            filler.check_source_shape(name, part.get_shape(), where)
                            cut = slice(where.lo, where.hi)
                            tensor = (part[cut] if where.dim == 0 else part[:, cut]
                                      if where.dim == 1 else part[:, :, cut])
                        filler.put(name, tensor, where)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot read weights ({exc}); the file may be corrupt "
                                 "or truncated") from None
    check.finish(name for name in check.expected if filler.targets(name))


def dummy_tensor(name: str, shape: tuple[int, ...], seed: int,
                 device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """The full dummy tensor `name`: norms are ones, the rest N(0, 0.02) from a generator seeded
    by (seed, name), so every partition of every layout sees the same full weights. Drawn on
    `device`: a GPU draws its own (other values than the CPU's, the same for every layout)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    gen = torch.Generator(device).manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return torch.empty(shape, device=device).normal_(0.0, 0.02, generator=gen)


def _fill_dummy(filler: _Filler, seed: int, device: torch.device) -> None:
    for name, shape in hf_tensor_shapes(filler.arch, quantized=False):
        wheres = filler.targets(name)
        if wheres:
            tensor = dummy_tensor(name, shape, seed, device)
            for where in wheres:
                filler.put(name, where.take(tensor), where)


def build_model(model_dir: Path, arch: ModelArch, dtype: torch.dtype, device: torch.device,
                max_positions: int, partition: ModelPartition = ModelPartition(),
                dummy: bool = False, seed: int = 0,
                tp_group: Optional[TensorParallelGroup] = None, pack: bool = True,
                quantization=None, lora=None) -> CausalLM:
    """Builds the partition (a TP rank needs its `tp_group`) and fills it from the safetensors in
    `model_dir`, or from the seeded dummy weights, slicing the same full tensors either way.
    Dummy weights on a GPU are built there in the model's dtype: an 8B model's fp32 draw on the
    host took longer than the benchmark it was for. lora: a lora_adapters.LoraSpec whose
    adapters this partition applies (its layers, its slices: model/lora.py)."""
    on_device = dummy and device.type == "cuda"
    model, filler = empty_partition(arch, max_positions, partition, tp_group,
                                    *((device, dtype) if on_device else ()))
    with torch.no_grad():
        if dummy:
            _fill_dummy(filler, seed, device if on_device else torch.device("cpu"))
            filler.check_complete("dummy weights")
        else:
            _read_weights(safetensor_files(model_dir), filler, arch, str(model_dir))
            filler.check_complete(str(model_dir))
    model = finish_partition(model, device, dtype, pack, quantization)
    if lora is not None:
        from .lora import attach_adapters

        attach_adapters(model, lora)
    return model


def empty_partition(arch: ModelArch, max_positions: int, partition: ModelPartition,
                    tp_group: Optional[TensorParallelGroup] = None,
                    device: torch.device = torch.device("cpu"),
                    dtype: torch.dtype = torch.float32) -> tuple[CausalLM, "_Filler"]:
    """The partition's modules on `device` in `dtype` (default fp32 host memory), unfilled, and the filler that maps Hugging
    Face tensors (or slices of them) onto its fused parameters."""
    with torch.device("meta"):
        model = CausalLM(arch, max_positions, partition, tp_group)
    _materialize(model, device, dtype)
    model.tie_weights()
    for module in model.modules():
        if isinstance(module, Rotary):
            module.reset()
    with torch.no_grad():
        for vocab_param in (model.embed_tokens, model.lm_head):
            if vocab_param is not None:  # the padding rows of the last vocab shard
                vocab_param.weight[model.shard.vocab_rows:].zero_()
    return model, _Filler(model)


def _materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Meta tensors -> uninitialized ones on `device`. Not Module.to_empty: its empty_like on
    meta tensors runs torch's Python reference ops, whose first use imports sympy and
    torch.fx (about a second of every process's startup)."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                           device=device)

    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(empty(param),
                                                     requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, empty(buffer),
                                   persistent=name not in module._non_persistent_buffers_set)


def finish_partition(model: CausalLM, device: torch.device, dtype: torch.dtype,
                     pack: bool = True, quantization=None) -> CausalLM:
    """Filled partition -> on its device, in its dtype, linears packed (unless `pack` is false:
    the caller still needs the plain weights; it packs them later with `linear_weight_dtype`),
    ready for inference. bf16 on CPU: fp32 everywhere but the packed linears' bf16 weights.
    quantization (int8_linear.LinearQuantization, model.quantization): int8 linears."""
    model = model.to(device=device, dtype=activation_dtype(device, dtype)).eval()
    model.requires_grad_(False)
    model.linear_weight_dtype = (torch.bfloat16 if activation_dtype(device, dtype) != dtype
                                 else torch.float32)
    model.linear_quantization = quantization
    if pack:
        pack_linears(model, weight_dtype=model.linear_weight_dtype, quantization=quantization)
        pack_experts(model, weight_dtype=model.linear_weight_dtype)
    return model


def load_arch(model_dir: Path, overrides: Optional[dict] = None) -> ModelArch:
    """config.json with `hf_overrides` applied; where they run fewer layers than the checkpoint
    has, the arch says so (its later layers' tensors are skipped, not an error). Its eos ids
    include generation_config.json's."""
    if not overrides:
        return with_generation_eos(read_arch(model_dir), model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    saved_layers = cfg.get("num_hidden_layers")
    cfg.update(overrides)
    layers = cfg.get("num_hidden_layers")
    if isinstance(saved_layers, int) and isinstance(layers, int) and 0 < layers < saved_layers:
        # per-layer lists (GPT-OSS / Gemma's layer_types) follow a smaller layer count: the first
        # layers' entries, as the checkpoint's first layers are the ones kept
        for key, value in cfg.items():
            if key not in overrides and isinstance(value, list) and len(value) == saved_layers:
                cfg[key] = value[:layers]
    arch = arch_from_dict(cfg, f"{model_dir / 'config.json'} with hf_overrides")
    if isinstance(saved_layers, int) and saved_layers > arch.num_layers:
        arch = dataclasses.replace(arch, checkpoint_layers=saved_layers)
    return with_generation_eos(arch, model_dir)
