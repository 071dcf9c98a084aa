"""A mixture-of-experts layer's experts, computed grouped by expert (no per-token Python).

Each token's router picks its top-k experts (`route`). The (token, expert) pairs are sorted by
expert (a stable argsort of the [T, k] assignments), the tokens gathered in that order, and each
expert that got any runs one GEMM chain over its contiguous run of rows: gate/up, SiLU-and-mul,
down. The rows are scaled by their routing weights and scatter-added back to their tokens
(index_add_). The Python loop is over the experts that got tokens, never over tokens; an expert
with none costs nothing.

The experts are stacked, `gate_up` [E, 2 I, H] (each expert's gate rows, then its up rows) and
`down` [E, H, I], so the same code runs on CUDA tensors. On CPU, `pack` lays each expert out in
the linears' panel kernel's layout (fast_linear.py) where the linears run one: the blocked
kernel's 16-wide panels (fp32, or bf16 widened as they are loaded) or, for bf16 on CPUs with
native bf16, the panels of k pairs of the amx kernel (AMX-BF16; k padded to 32) or the dpbf16
kernel (AVX512-BF16 without AMX); the expert's gate/up GEMM runs SiLU-and-mul as its epilogue.
Elsewhere each expert is torch's linear over its slice of the stack.

The per-expert token counts (a bincount of the assignments, which the grouping needs anyway) are
added into `load`, a [E] tensor on the model's device that the executor reads once per step
(CausalLM.take_expert_load).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .fast_linear import (PANEL, AmxBf16Linear, amx_available, bf16_dot_available,
                          blocked_kernel_available, from_bf16_pairs, linear_kernel_for,
                          to_bf16_pairs)


PAIRED_KERNELS = ("dpbf16", "amx")     # panel kernels whose panels hold k in bf16 pairs


def route(router_logits: torch.Tensor, top_k: int, normalize: bool):
    """Softmax over the experts (in fp32), the top_k of each token, renormalized to sum to 1
    where the model does -> (weights [T, k] fp32, expert ids [T, k]). As transformers routes."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_topk_softmax(router_logits: torch.Tensor, top_k: int):
    """GPT-OSS: the top_k logits of each token, softmaxed among themselves (in fp32) -> (weights
    [T, k], expert ids [T, k]). As transformers' GptOssTopKRouter."""
    values, ids = torch.topk(router_logits.float(), top_k, dim=-1)
    return torch.softmax(values, dim=-1), ids


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation over [rows, 2 I] (gate columns, then up): gate clamped above at
    `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class StackedExperts(nn.Module):
    """Every expert's gate/up and down projections (this TP rank's intermediate rows of each)."""

    def __init__(self, num_experts: int, hidden_size: int, rows: int):
        super().__init__()
        self.num_experts, self.hidden_size, self.rows = num_experts, hidden_size, rows
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * rows, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, rows))
        self.panels: Optional[tuple[torch.Tensor, torch.Tensor]] = None   # set by pack()
        self.panel_kernel: Optional[str] = None     # with panels: blocked, dpbf16 or amx
        self.panel_ops = None      # with panels: the kernel's (linear, linear_silu_mul), _panel_ops
        self.load: Optional[torch.Tensor] = None    # tokens routed to each expert, since taken
        # CUDA: every expert in two grouped Triton kernels with no host read (triton_moe.py),
        # set by use_triton_experts; False: one GEMM chain per expert that got tokens
        self.triton_kernels = False

    def pack(self, weight_dtype: torch.dtype = torch.float32) -> None:
        """CPU: each expert in the blocked kernel's panels where it is the linears' kernel and
        the widths split into whole panels (gate/up into pairs, for the SiLU epilogue); else
        bf16 weights rounded and held in fp32 (torch's GEMM over the rounded values)."""
        if self.gate_up.device.type != "cpu" or self.gate_up.dtype != torch.float32:
            return
        kernel = linear_kernel_for(self.gate_up.device, weight_dtype)
        fits = self.rows % PANEL == 0 and self.hidden_size % PANEL == 0
        if kernel == "dpbf16" and fits and bf16_dot_available():
            self.panels = (to_bf16_pairs(self.gate_up), to_bf16_pairs(self.down))
        elif kernel == "amx" and fits and amx_available():
            k = AmxBf16Linear.k_multiple
            self.panels = (to_bf16_pairs(self.gate_up, k), to_bf16_pairs(self.down, k))
        elif kernel == "blocked" and fits and blocked_kernel_available():
            self.panels = (_to_panels(self.gate_up.detach().to(weight_dtype)),
                           _to_panels(self.down.detach().to(weight_dtype)))
        if self.panels is not None:
            self.panel_kernel = kernel
            self.panel_ops = _panel_ops(kernel)
            empty = torch.empty(0)        # the dense stacks are not used again
            self.gate_up, self.down = nn.Parameter(empty), nn.Parameter(empty.clone())
        elif weight_dtype == torch.bfloat16:
            with torch.no_grad():
                for stack in (self.gate_up, self.down):
                    stack.copy_(stack.to(torch.bfloat16).float())

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                ops) -> torch.Tensor:
        """x [T, H], the routing (route()) -> sum over each token's experts of weight x
        expert(x), [T, H] (this rank's share of it under TP: the caller all-reduces)."""
        if self.triton_kernels:
            from ..triton_moe import fused_experts

            out, counts = fused_experts(x, weights, ids, self.gate_up, self.down,
                                        self._activation(ops), *self._biases())
            self.load = counts if self.load is None else self.load.add_(counts)
            return out
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)          # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.load = counts if self.load is None else self.load.add_(counts)
        token = torch.div(order, top_k, rounding_mode="floor")
        rows = x.index_select(0, token)
        out = torch.empty_like(rows)
        start = 0
        for expert, n in enumerate(counts.tolist()):     # one host read of E counts
            if n:
                out[start:start + n] = self._expert(expert, rows[start:start + n], ops)
                start += n
        out.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1).to(out.dtype))
        return torch.zeros_like(x).index_add_(0, token, out)

    def _activation(self, ops):
        """[rows, 2 I] (gate columns, then up) -> [rows, I], as _expert applies it."""
        return ops.silu_and_mul

    def _biases(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(gate/up bias [E, 2 I], down bias [E, H]), None where the experts have none."""
        return None, None

    def _linear(self, x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
        return self.panel_ops[0](x, panels)

    def _expert(self, expert: int, x: torch.Tensor, ops) -> torch.Tensor:
        if self.panels is not None:
            gate_up, down = self.panels
            inner = self.panel_ops[1](x, gate_up[expert])
            return self._linear(inner, down[expert])
        inner = ops.silu_and_mul(F.linear(x, self.gate_up[expert]))
        return F.linear(inner, self.down[expert])

    def dense_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2 I, H], down [E, H, I]) back from the panels where packed."""
        if self.panels is None:
            return self.gate_up.detach(), self.down.detach()
        if self.panel_kernel in PAIRED_KERNELS:
            return (from_bf16_pairs(self.panels[0], self.hidden_size),
                    from_bf16_pairs(self.panels[1], self.rows))
        return tuple(p.transpose(2, 3).reshape(p.shape[0], p.shape[1] * PANEL, p.shape[2])
                     for p in self.panels)


class BiasedExperts(StackedExperts):
    """StackedExperts with a bias after each projection and GPT-OSS's clamped SwiGLU instead of
    SiLU-and-mul (`swiglu` = (alpha, limit)). Only `_expert` differs, so the other families keep
    StackedExperts' code as it was. Under TP each rank holds its rows of `gate_up_bias`
    [E, 2 I] and the whole `down_bias` [E, H] on rank 0 only (zeros elsewhere: the all-reduce
    adds it once, each copy scaled by its routing weight as the rest of the expert's output)."""

    def __init__(self, num_experts: int, hidden_size: int, rows: int,
                 swiglu: tuple[float, float]):
        super().__init__(num_experts, hidden_size, rows)
        self.alpha, self.limit = float(swiglu[0]), float(swiglu[1])
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * rows))
        self.down_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    def _expert(self, expert: int, x: torch.Tensor, ops) -> torch.Tensor:
        if self.panels is not None:
            gate_up, down = self.panels
            h = self._linear(x, gate_up[expert])
            h += self.gate_up_bias[expert]
            out = self._linear(clamped_swiglu(h, self.alpha, self.limit), down[expert])
            out += self.down_bias[expert]
            return out
        h = F.linear(x, self.gate_up[expert], self.gate_up_bias[expert])
        return F.linear(clamped_swiglu(h, self.alpha, self.limit), self.down[expert],
                        self.down_bias[expert])

    def _activation(self, ops):
        return lambda h: clamped_swiglu(h, self.alpha, self.limit)

    def _biases(self):
        return self.gate_up_bias, self.down_bias


def _panel_ops(kernel: str):
    """(linear, linear with the SiLU-and-mul epilogue) of a panel kernel, over one expert's
    panels (no bias)."""
    ops = torch.ops.batchinfer
    if kernel == "amx":     # looked up at the call: a build without AMX has no such ops
        return (lambda x, w: ops.amx_linear(x, w, None),
                lambda x, w: ops.amx_linear_silu_mul(x, w))
    if kernel == "dpbf16":
        return ops.bf16_linear, ops.bf16_linear_silu_mul
    return ops.blocked_linear, ops.blocked_linear_silu_mul


def _to_panels(stack: torch.Tensor) -> torch.Tensor:
    """[E, out, in] -> [E, out / 16, in, 16]: each expert as fast_linear.to_blocked lays one
    linear out (expert e's panels contiguous at [e])."""
    experts, out_features, in_features = stack.shape
    return (stack.reshape(experts, out_features // PANEL, PANEL, in_features)
            .transpose(2, 3).contiguous())


def use_triton_experts(model: nn.Module) -> int:
    """Every StackedExperts of `model` (its stacks unpacked: on CUDA) computes through
    triton_moe's grouped kernels; returns how many there were."""
    stacks = [m for m in model.modules() if isinstance(m, StackedExperts)]
    for stack in stacks:
        if stack.panels is not None:
            raise ValueError("the Triton experts need the dense stacks; these are packed for "
                             "the CPU's panel kernels")
        stack.triton_kernels = True
    return len(stacks)


def pack_experts(model: nn.Module, weight_dtype: torch.dtype = torch.float32) -> int:
    """Packs every StackedExperts of `model` (pack()); returns how many there were."""
    stacks = [m for m in model.modules() if isinstance(m, StackedExperts)]
    for stack in stacks:
        stack.pack(weight_dtype)
    return len(stacks)
