"""int8 linears on CPU (`model.quantization: int8`): W8A8 over kernels/int8_linear.cpp.

Each weight row (output channel) is quantized once, at load, to int8 with its own scale (absmax /
127, symmetric); each activation row (token) is quantized the same way at every call, inside the
kernel, with one scale per block of 64 input channels, so no calibration data is needed. One
scale per token was measured too coarse: SmolLM2-135M's few large activation channels flattened
the rest of the token (teacher-forced top-1 agreement with transformers fp32 0.93, worst
next-token log-prob difference 1.58; per block of 64: 0.97, 0.62). The int8 products are
summed exactly in int32 by AVX512-VNNI's vpdpbusd, per block, and scaled back to fp32: the same
inputs give the same outputs whatever batch a token is in. Outside the linears (norms, rotary,
attention, the KV cache, sampling) nothing changes.

The LM head stays in the model's format unless `model.quantize_lm_head` (as llm-compressor's
and vLLM's W8A8 checkpoints leave it): it is one matrix, but its logits are what sampling reads.
MoE experts and routers stay unquantized (a router's int8 logits could pick other experts): a
module that must keep its precision carries `quantizable = False`. fp16 models are refused (the
kernel takes fp32 activations; bf16 models on CPU have them). AMX-INT8 CPUs have AVX512-VNNI,
so they run this kernel too. The length predictor's BERT encoder runs its linears here as well
(`predictor.encoder_int8`), its feed-forward's GELU fused into the output (`Int8Linear.gelu`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..host_cpu import cpu_identity

PANEL = 16
GROUP = 4          # k per int32 lane of vpdpbusd
BLOCK = 64         # input channels per activation scale (the kernel's BLOCK)
QUANTIZATIONS = ("int8",)
# what the kernel is compiled for: AVX-512 with its byte/word and dword/qword parts, and VNNI
INT8_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512_vnni")


def int8_missing_flags() -> tuple[str, ...]:
    """The instruction-set flags int8 linears need that this CPU lacks (empty: it can run them)."""
    _, flags = cpu_identity()
    if not flags:        # no /proc/cpuinfo: torch's own view of the CPU
        return () if torch.backends.cpu.get_cpu_capability() == "AVX512" and _kernel_built() \
            else ("avx512_vnni",)
    return tuple(f for f in INT8_FLAGS if f not in flags)


def _kernel_built() -> bool:
    from batchinfer.engine.kernels import load_native_kernels

    return (load_native_kernels() and hasattr(torch.ops.batchinfer, "int8_linear_isa")
            and torch.ops.batchinfer.int8_linear_isa() == "avx512_vnni")


def int8_kernel_available() -> bool:
    """This CPU has the instructions and the native kernels built with them."""
    return not int8_missing_flags() and _kernel_built()


@dataclass(frozen=True)
class LinearQuantization:
    """What `model.quantization` asks of the linears (`pack_linears`)."""
    method: str = "int8"
    lm_head: bool = False       # model.quantize_lm_head

    def describe(self) -> str:
        head = "LM head too" if self.lm_head else "LM head in the model's dtype"
        return (f"{self.method} (AVX512-VNNI: int8 weights per output channel, int8 activations "
                f"per token and per 64 input channels, int32 sums; {head})")


def check_quantization_setting(method: Optional[str], device_type: str,
                               dtype: Optional[torch.dtype] = None) -> None:
    """What the recipe alone decides (`batchinfer validate`: dtype None while it is auto); the
    CPU's instructions and the kernels are resolve_quantization's to check where the job runs."""
    if method is None:
        return
    if method not in QUANTIZATIONS:
        raise ConfigError(f"model.quantization: {method!r} is not one of {', '.join(QUANTIZATIONS)}")
    if device_type != "cpu":
        raise ConfigError(f"model.quantization: {method} runs on CPU only (AVX512-VNNI kernels); "
                          f"on {device_type} leave it empty")
    if dtype == torch.float16:
        raise ConfigError(f"model.quantization: {method} takes fp32 activations; model.dtype: "
                          "float16 has none on CPU: use float32, bfloat16 or auto")


def resolve_quantization(method: Optional[str], lm_head: bool, device: torch.device,
                         dtype: torch.dtype = torch.float32) -> Optional[LinearQuantization]:
    """model.quantization -> what the linears run, or a ConfigError naming what is missing."""
    if method is None:
        return None
    check_quantization_setting(method, device.type, dtype)
    missing = int8_missing_flags()
    if missing:
        cpu, _ = cpu_identity()
        raise ConfigError(f"model.quantization: {method} needs a CPU with {', '.join(INT8_FLAGS)} "
                          f"(AMX-INT8 CPUs have them); this one ({cpu or 'unknown CPU'}) lacks "
                          f"{', '.join(missing)}. Leave model.quantization empty to run the "
                          "model in its dtype")
    if not _kernel_built():
        raise ConfigError(f"model.quantization: {method} needs the native CPU kernels, which are "
                          "unavailable here (BATCHINFER_NATIVE_KERNELS=0, or their build failed: "
                          "see the log)")
    return LinearQuantization(method, lm_head)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 codes [N, K], fp32 scales [N]): per output channel, symmetric."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def padded(k: int) -> int:
    """K rounded up to whole activation blocks (the codes and weights are zero past K)."""
    return -(-k // BLOCK) * BLOCK


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [N / 16, Kp / 4, 16, 4] (zeros past K): the kernel's panels, 4 k of a panel's
    16 columns one 64-byte load."""
    n, k = codes.shape
    kp = padded(k)
    return (F.pad(codes, (0, kp - k)).reshape(n // PANEL, PANEL, kp // GROUP, GROUP)
            .permute(0, 2, 1, 3).contiguous())


def block_compensation(codes: torch.Tensor) -> torch.Tensor:
    """int32 [Kp / 64, N]: 128 x each column's code sum per block. vpdpbusd takes the token's codes
    as unsigned (q + 128); this is what each block's sum takes back."""
    n, k = codes.shape
    sums = F.pad(codes.to(torch.int32), (0, padded(k) - k)).reshape(n, -1, BLOCK).sum(dim=2)
    return (sums * 128).T.contiguous().to(torch.int32)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch (the reference tests hold the kernel to):
    [M, K] fp32 -> (int8 codes [M, Kp], fp32 scales [M, Kp / 64]), per block of 64 channels
    codes = round(x * (127 / absmax)), zero past K and for a NaN (whose block's scale is NaN)."""
    m, k = x.shape
    blocks = F.pad(x, (0, padded(k) - k)).reshape(m, -1, BLOCK)
    absmax = blocks.abs().amax(dim=2)
    # a true division, as the kernel's 127.f / absmax (a Python number over a tensor would be
    # absmax.reciprocal() * 127: two roundings, another code at about 1 in a million)
    inv = torch.where(absmax > 0, absmax.new_tensor(127.0) / absmax, torch.zeros_like(absmax))
    codes = torch.round(blocks * inv[:, :, None]).nan_to_num_(0.0).to(torch.int8).reshape(m, -1)
    return codes, absmax / 127.0


class Int8Linear(nn.Module):
    """A Linear whose weight is int8 per output channel; input and output fp32 (see the module
    doc). The output width must be a multiple of 16 (whole panels)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        codes, self.scale = quantize_weight(linear.weight)
        self.packed = pack_codes(codes)
        self.comp = block_compensation(codes)
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def _run(self, x: torch.Tensor, silu_mul: bool, width: int, gelu: bool = False) -> torch.Tensor:
        flat = x.dim() == 2
        y = torch.ops.batchinfer.int8_linear(x if flat else x.reshape(-1, self.in_features),
                                             self.packed, self.scale, self.comp, self.bias, silu_mul,
                                             gelu)
        return y if flat else y.reshape(*x.shape[:-1], width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, False, self.out_features)

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        """F.gelu(self(x)), the exact (erf) GELU, in one pass: the output leaves the kernel once."""
        return self._run(x, False, self.out_features, gelu=True)

    @property
    def can_fuse_silu_mul(self) -> bool:
        """A gate/up projection whose halves split into whole panels."""
        return self.out_features % (2 * PANEL) == 0

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this gate/up projection in one pass (see can_fuse_silu_mul)."""
        return self._run(x, True, self.out_features // 2)

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight the kernel multiplies by: the codes times their scales."""
        groups = self.packed.shape[1]
        codes = self.packed.permute(0, 2, 1, 3).reshape(self.out_features, groups * GROUP)
        return codes[:, :self.in_features].float() * self.scale[:, None]
