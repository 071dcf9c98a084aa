"""Faster fp32 linears on CPU: weights laid out once, at load time, for a GEMM kernel.

torch's default CPU linear re-packs the weight matrix on every call; at decode batch sizes (tens
to hundreds of rows) that costs as much as the multiply. Two kernels avoid it:

- `blocked`: kernels/blocked_linear.cpp over weights in panels of 16 output rows ([out / 16, in,
  16]). An AVX2 tile (6 rows x one panel) and, where the build has AVX-512, a wider one (12 rows
  x two panels, one zmm per panel row; the op's wide=False: the AVX2 tile). Each output row
  is one FMA chain over k in order, so its bits do not depend on the batch or on the tile. On the
  AVX2-only AMD EPYC this project runs on, the AVX2 tile measured 1.2-1.4x oneDNN's packed GEMM
  on SmolLM2's shapes at 16-256 rows on two threads; on an AVX-512 Xeon the AVX-512 tile measured
  1.45x oneDNN at 16 rows, 1.14-1.16x at 128 and 0.95x at 512 (benchmarks/engine/gemm_roofline.py). It
  prefetches the next panel while it computes the current one, so at decode batch sizes the
  weights' DRAM stream overlaps the FMAs (the op's prefetch=False: off). The MLP's gate/up
  projection runs SiLU-and-mul as the kernel's epilogue (`BlockedLinear.silu_mul`,
  engine/model/ops.py; NativeOps.fuse_silu_mul = False: off).
- `onednn`: oneDNN's own packed (opaque) weights: the default where the blocked kernel has
  neither tile's instruction set to itself (an AVX2 tile on an AVX-512 CPU: oneDNN was 1.2-1.3x
  faster there).

BATCHINFER_LINEAR_KERNEL picks one (auto, blocked, onednn, torch); auto takes `blocked` on a CPU
whose best instruction set is AVX2, or AVX-512 with the kernel's AVX-512 tile built, else
`onednn` (engine/envs.py). On CUDA the modules are left as they are.

bf16 on CPU (engine/cpu_dtype.py) keeps the activations in fp32 and only the linears' weights in
bf16, laid out by `bf16_linear_kernel()` (BATCHINFER_BF16_LINEAR_KERNEL overrides it):
- `amx` on CPUs with AMX-BF16 whose tiles Linux grants: kernels/amx_linear.cpp, the same
  panels with k padded to 32, TDPBF16PS over 16 x 32 input tiles and 32 x 16 weight tiles, fp32
  sums, fp32 out (`AmxBf16Linear`; bias and SiLU-and-mul epilogues). On the project's AMX Xeon
  SmolLM2's decode GEMMs ran 1.2x oneDNN's bf16 GEMM at 128 rows, 1.3x at 16 and 2.5x at one row
  (docs/performance.md).
- `dpbf16` on CPUs with AVX512-BF16 and no AMX: kernels/bf16_linear.cpp, the weights in panels
  of 16 columns with k in pairs, the input rounded to bf16 inside the kernel, fp32 sums by
  vdpbf16ps, fp32 out (`PairedBf16Linear`; gate/up with SiLU-and-mul as its epilogue). On the
  AMD EPYC (Zen 4) with AVX512-BF16, SmolLM2's decode GEMMs at 128 rows ran 1.9x the fp32
  blocked kernel and 1.04x oneDNN's bf16 GEMM alone, more in the engine's step, where oneDNN also
  pays the input's conversion and the output's rounding (docs/performance.md). On the AMX Xeon
  vdpbf16ps measured half the fp32 FMA rate, so auto never takes it where AMX is usable.
- `onednn` for widths that do not split into panels, and on AMX CPUs where Linux refuses the
  tiles: oneDNN's packed bf16 GEMM (the input rounded to bf16, fp32 accumulation, the output
  rounded to bf16 and widened back);
- elsewhere (no native bf16) the blocked kernel over bf16 panels, widened to fp32 as they are
  loaded (exact: the fp32 FMA chains over the rounded weights), because oneDNN emulates bf16
  there (5x slower than fp32 on an AVX-512 Xeon, ~300x on AVX2-only CPUs).
"""
from __future__ import annotations

import logging
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from .. import envs

log = logging.getLogger(__name__)
PACK_BATCH_HINT = 128
PANEL = 16
LINEAR_KERNELS = ("auto", "blocked", "onednn", "torch")
BF16_LINEAR_KERNELS = ("auto", "amx", "dpbf16", "onednn", "blocked", "torch")


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def blocked_kernel_available() -> bool:
    """The kernel is built and has its AVX2 path (without it, it is a copying fallback)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    from batchinfer.engine.kernels import load_native_kernels

    return load_native_kernels() and hasattr(torch.ops.batchinfer, "blocked_linear")


def blocked_kernel_isa() -> str:
    """The blocked kernel's tile here: avx512, avx2, or none (not built / no AVX2 path)."""
    if not blocked_kernel_available():
        return "none"
    return str(torch.ops.batchinfer.blocked_linear_isa())


@lru_cache(maxsize=None)
def _resolve(requested: str) -> str:
    if requested not in LINEAR_KERNELS:
        raise ValueError(f"BATCHINFER_LINEAR_KERNEL={requested!r}: expected one of "
                         f"{', '.join(LINEAR_KERNELS)}")
    chosen = requested
    if chosen == "auto":
        capability = torch.backends.cpu.get_cpu_capability()
        own_tile = capability == "AVX2" or (capability == "AVX512" and blocked_kernel_isa() == "avx512")
        chosen = "blocked" if own_tile else "onednn"
    if chosen == "blocked" and not blocked_kernel_available():
        if requested == "blocked":
            log.warning("BATCHINFER_LINEAR_KERNEL=blocked: the native AVX2 kernels are unavailable here")
        chosen = "onednn"
    if chosen == "onednn" and not onednn_available():
        chosen = "torch"
    return chosen


def linear_kernel() -> str:
    """The kernel fp32 CPU linears use here: blocked, onednn or torch (see the module doc)."""
    return _resolve(envs.get("BATCHINFER_LINEAR_KERNEL").strip().lower())


def bf16_dot_available() -> bool:
    """The native kernels are built with AVX512-BF16's dot products (kernels/bf16_linear.cpp)."""
    return (blocked_kernel_available() and hasattr(torch.ops.batchinfer, "bf16_linear_isa")
            and torch.ops.batchinfer.bf16_linear_isa() == "avx512_bf16")


def amx_available() -> bool:
    """The native kernels are built with AMX-BF16 tiles and Linux grants them (kernels/amx_linear.cpp)."""
    return (blocked_kernel_available() and hasattr(torch.ops.batchinfer, "amx_bf16_isa")
            and torch.ops.batchinfer.amx_bf16_isa() == "amx_bf16")


@lru_cache(maxsize=None)
def _resolve_bf16(requested: str, native: tuple[str, ...]) -> str:
    if requested not in BF16_LINEAR_KERNELS:
        raise ValueError(f"BATCHINFER_BF16_LINEAR_KERNEL={requested!r}: expected one of "
                         f"{', '.join(BF16_LINEAR_KERNELS)}")
    available = {"amx": amx_available(), "dpbf16": bf16_dot_available(),
                 "onednn": onednn_available(),
                 "blocked": blocked_kernel_available(), "torch": True}
    if requested != "auto":
        if available[requested]:
            return requested
        log.warning("BATCHINFER_BF16_LINEAR_KERNEL=%s: unavailable here; choosing as auto does",
                    requested)
    if "amx_bf16" in native and available["amx"]:
        return "amx"
    if "avx512_bf16" in native and "amx_bf16" not in native and available["dpbf16"]:
        return "dpbf16"
    if native and available["onednn"]:
        return "onednn"
    return "blocked" if available["blocked"] else "torch"


def bf16_linear_kernel() -> str:
    """The kernel bf16 CPU linears use here (see the module doc): dpbf16 on AVX512-BF16 CPUs
    without AMX, onednn where the CPU has other native bf16 arithmetic (AMX), else blocked (bf16
    panels widened to fp32), else torch (fp32 over the rounded weights): never oneDNN's emulated
    bf16 GEMM unless BATCHINFER_BF16_LINEAR_KERNEL asks for it."""
    from ..cpu_dtype import native_bf16_flags

    return _resolve_bf16(envs.get("BATCHINFER_BF16_LINEAR_KERNEL").strip().lower(),
                         native_bf16_flags())


def linear_kernel_for(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel a model on `device` in `dtype` runs its linears with (engine.linear_kernel)."""
    if device.type != "cpu":
        return "torch"
    if dtype == torch.bfloat16:
        return bf16_linear_kernel()
    return linear_kernel() if dtype == torch.float32 else "torch"


def linear_kernel_label(device: torch.device, dtype: torch.dtype, quantization=None) -> str:
    """linear_kernel_for, naming the blocked kernel's tile, bf16 weights and int8 linears
    (report.json's engine.linear_kernel); quantization: an int8_linear.LinearQuantization."""
    kernel = linear_kernel_for(device, dtype)
    label = {"blocked": f"blocked ({blocked_kernel_isa()} tile)",
             "dpbf16": "dpbf16 (avx512_bf16 dot products, fp32 sums)",
             "amx": "amx (amx_bf16 tiles, fp32 sums)"}.get(kernel, kernel)
    if device.type == "cpu" and dtype == torch.bfloat16:
        label += ", bf16 weights, fp32 activations"
    if quantization is not None:
        rest = "widths not a multiple of 16" if quantization.lm_head else "LM head"
        label = f"int8 (avx512_vnni); {rest}: {label}"
    return label


def to_blocked(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out / 16, in, 16] (a view): panel p holds output rows 16 p .. 16 p + 15, in-major."""
    out_features, in_features = weight.shape
    return weight.reshape(out_features // PANEL, PANEL, in_features).transpose(1, 2)


def to_bf16_pairs(weight: torch.Tensor, k_multiple: int = 2) -> torch.Tensor:
    """[..., out, in] -> bf16 [..., out / 16, Kp / 2, 16, 2], Kp = in rounded up to k_multiple
    (zeros past in): panel p's k pair g is one 64-byte line, each 32-bit lane
    (w[16 p + c][2 g], w[16 p + c][2 g + 1])."""
    *lead, out_features, in_features = weight.shape
    pairs = -(-in_features // k_multiple) * k_multiple // 2
    w = F.pad(weight.detach().to(torch.bfloat16), (0, 2 * pairs - in_features))
    w = w.reshape(*lead, out_features // PANEL, PANEL, pairs, 2)
    return w.transpose(-3, -2).contiguous()


def from_bf16_pairs(pairs: torch.Tensor, in_features: int) -> torch.Tensor:
    """to_bf16_pairs' inverse: [..., out, in] bf16."""
    *lead, panels, k_pairs, _, _ = pairs.shape
    return pairs.transpose(-3, -2).reshape(*lead, panels * PANEL, 2 * k_pairs)[..., :in_features]


class PairedBf16Linear(nn.Module):
    """A Linear for kernels/bf16_linear.cpp (AVX512-BF16): bf16 weights as to_bf16_pairs lays
    them out, fp32 in and out (the input rounded to bf16 in the kernel, the products summed in
    fp32), the bias added in fp32."""

    k_multiple = 2      # the kernel's k step: the pairs are padded (zeros) to a multiple of it

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.pairs = to_bf16_pairs(linear.weight, self.k_multiple)
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.batchinfer.bf16_linear(x, self.pairs)
        return y if self.bias is None else y.add_(self.bias)

    def _matmul_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.batchinfer.bf16_linear_silu_mul(x, self.pairs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:    # the engine's [tokens, features]: no reshapes on the hot path
            return self._matmul(x)
        y = self._matmul(x.reshape(-1, self.in_features))
        return y.reshape(*x.shape[:-1], self.out_features)

    @property
    def can_fuse_silu_mul(self) -> bool:
        """A gate/up projection whose halves split into whole panels, with no bias."""
        return self.bias is None and self.out_features % (2 * PANEL) == 0

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate/up projection in one pass (see can_fuse_silu_mul)."""
        if x.dim() == 2:
            return self._matmul_silu_mul(x)
        y = self._matmul_silu_mul(x.reshape(-1, self.in_features))
        return y.reshape(*x.shape[:-1], self.out_features // 2)

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] bf16 weight back from the pairs."""
        return from_bf16_pairs(self.pairs, self.in_features)


class AmxBf16Linear(PairedBf16Linear):
    """A Linear for kernels/amx_linear.cpp (AMX-BF16 tiles): the same panels of k pairs with k
    padded to a multiple of 32 (one tile step), the bias added in the kernel's epilogue."""

    k_multiple = 32

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.batchinfer.amx_linear(x, self.pairs, self.bias)

    def _matmul_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.batchinfer.amx_linear_silu_mul(x, self.pairs)


class PackedLinear(nn.Module):
    """A Linear whose weight lives in oneDNN's blocked layout (same maths, same parameters).
    With weight_dtype bf16 the input is rounded to bf16 for the GEMM and the output widened back:
    fp32 in, fp32 out."""

    def __init__(self, linear: nn.Linear, weight_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_dtype = weight_dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().to(weight_dtype),
                                                              PACK_BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach().to(weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_dtype == x.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.weight_dtype), self.packed, self.bias,
                                               "none", [], "")
        return y.to(x.dtype)

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight back from the opaque layout (exact: a product with the identity)."""
        eye = torch.eye(self.in_features, dtype=self.weight_dtype)
        return torch.ops.mkldnn._linear_pointwise(eye, self.packed, None, "none", [], "").T


class BlockedLinear(nn.Module):
    """A Linear whose weight lives in 16-wide panels for kernels/blocked_linear.cpp, in fp32 or
    bf16 (widened exactly as the kernel loads them); the input and output are fp32 either way."""

    # the kernel's switches, for measuring them (the same bits either way): prefetch the next
    # panel during this one's FMAs; the AVX-512 tile where built (False: the AVX2 tile)
    prefetch = True
    wide = True

    def __init__(self, linear: nn.Linear, weight_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.blocked = to_blocked(linear.weight.detach().to(weight_dtype)).contiguous()
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2  # the engine's [tokens, features]: no reshapes on the hot path
        y = torch.ops.batchinfer.blocked_linear(x if flat else x.reshape(-1, self.in_features),
                                                self.blocked, self.prefetch, self.wide)
        if self.bias is not None:
            y.add_(self.bias)
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)

    @property
    def can_fuse_silu_mul(self) -> bool:
        """A gate/up projection whose halves split into whole panels, with no bias."""
        return self.bias is None and self.out_features % (2 * PANEL) == 0

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate/up projection in one pass (see can_fuse_silu_mul)."""
        if x.dim() == 2:
            return torch.ops.batchinfer.blocked_linear_silu_mul(x, self.blocked, self.prefetch,
                                                                self.wide)
        y = torch.ops.batchinfer.blocked_linear_silu_mul(x.reshape(-1, self.in_features),
                                                         self.blocked, self.prefetch, self.wide)
        return y.reshape(*x.shape[:-1], self.out_features // 2)

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight back from the panels."""
        return self.blocked.transpose(1, 2).reshape(self.out_features, self.in_features)


def pack_linears(model: nn.Module, kernel: str | None = None,
                 weight_dtype: torch.dtype = torch.float32, quantization=None) -> int:
    """Swaps every fp32 CPU nn.Linear in `model` for the kernel's module (a BlockedLinear where the
    output width is a multiple of 16, else a PackedLinear) with its weight in `weight_dtype` (fp32,
    or bf16 for a bf16 model on CPU: fp32 activations, bf16 weights); returns how many were
    swapped. quantization (an int8_linear.LinearQuantization): an Int8Linear instead wherever the
    width is a multiple of 16 and the module is `quantizable` (MoE routers are not), the
    top-level `lm_head` only if it asks for it."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if (type(child) is nn.Linear and child.weight.device.type == "cpu"
                   and child.weight.dtype == torch.float32)]
    if not targets:                  # CUDA or fp16: nothing to lay out, no kernels to build
        return 0
    swapped = 0
    if quantization is not None:
        from .int8_linear import Int8Linear

        kept = []
        while targets:               # popped, so each original is freed once quantized
            parent, name, child = targets.pop()
            is_head = parent is model and name == "lm_head"
            if (child.out_features % PANEL == 0 and getattr(child, "quantizable", True)
                    and (quantization.lm_head or not is_head)):
                setattr(parent, name, Int8Linear(child))
                swapped += 1
            else:
                kept.append((parent, name, child))
        targets = kept
    bf16 = weight_dtype == torch.bfloat16
    kernel = kernel or (bf16_linear_kernel() if bf16 else linear_kernel())
    if not targets:
        return swapped
    if kernel == "blocked" and not blocked_kernel_available():    # also loads the native op
        kernel = "onednn"
    if kernel == "dpbf16" and not (bf16 and bf16_dot_available()):
        kernel = "onednn"
    if kernel == "amx" and not (bf16 and amx_available()):
        kernel = "onednn"
    if kernel == "torch" and not bf16:
        return swapped
    while targets:                   # popped, so each original is freed once swapped
        parent, name, child = targets.pop()
        if kernel == "dpbf16" and child.out_features % PANEL == 0:
            setattr(parent, name, PairedBf16Linear(child))
        elif kernel == "amx" and child.out_features % PANEL == 0:
            setattr(parent, name, AmxBf16Linear(child))
        elif kernel == "blocked" and child.out_features % PANEL == 0:
            setattr(parent, name, BlockedLinear(child, weight_dtype))
        elif bf16 and kernel not in ("onednn", "dpbf16", "amx"):
            # no native bf16 (or torch asked for): oneDNN's bf16 would be emulated, 5-300x slower
            setattr(parent, name, RoundedWeightLinear(child))
        elif onednn_available() and kernel != "torch":
            setattr(parent, name, PackedLinear(child, weight_dtype))
        elif bf16:
            setattr(parent, name, RoundedWeightLinear(child))
        else:
            continue
        swapped += 1
    return swapped


class RoundedWeightLinear(nn.Module):
    """bf16 weights where neither the blocked kernel (a width that does not split into panels, or
    no native kernels) nor a native bf16 GEMM runs: torch's fp32 linear over the weight rounded to
    bf16 (the blocked kernel's maths at fp32's speed; the memory of fp32)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight.detach().to(torch.bfloat16).float()
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)
