"""Hardware presets (the GPUs the papers ran on) and a roofline cost model for a model on them.

Specs come from the papers' tables where they give them (TD-Pipe Table 1: L20 and A100-PCIe with
their measured all-reduce bandwidth; Seesaw Table 1: A10, L4, A100-SXM; gLLM §5: L20 PCIe
p2p 20.79 GB/s; SiDP Table 1: H20 / H200 memory, NVLink 4); the rest from the vendors'
datasheets, marked as such in `source`.

The roofline: a decoder layer on one rank takes the longer of its FLOPs at COMPUTE_EFFICIENCY x
peak and its bytes (the rank's weight shard, the KV its decode queries read) at
MEMORY_EFFICIENCY x bandwidth, plus a fixed per-layer launch overhead; under TP, two
all-reduces of the micro-batch's hidden states per layer at the preset's all-reduce bandwidth
(TD-Pipe's definition: tensor bytes / all-reduce time). The last stage adds the LM head (same
roofline) and sampling (a few passes over the logits). Host copies (Seesaw's KV tier and weight
reloads, SiPipe's logits) go over the preset's PCIe link to the host. Efficiencies and overheads
are stated assumptions, the same for every preset, so rankings come from the specs.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cost_model import ACTIVATIONS_PER_TOKEN, BatchShape
from .profile_table import LinkCost

GB, GiB = 10**9, 2**30


@dataclass(frozen=True)
class HardwarePreset:
    name: str
    tflops: float              # dense FP16/BF16 tensor-core peak
    memory_bandwidth: float    # bytes/s
    memory: float              # bytes per GPU
    interconnect: str          # pcie | nvlink
    allreduce_bandwidth: float  # bytes/s of tensor per second of all-reduce, 4 GPUs
    p2p_bandwidth: float       # bytes/s between two GPUs
    host_bandwidth: float      # bytes/s between a GPU and host memory (PCIe)
    source: str


PCIE4_X8 = 16 * GiB            # Seesaw §6.1: PCIe 4.0 x8 per GPU
PCIE4_X16 = 25 * GB            # PCIe 4.0 x16 as achieved (assumed)
PCIE5_X16 = 50 * GB            # PCIe 5.0 x16 as achieved (assumed)
NVLINK3 = 600 * GiB            # Seesaw §6.1
NVLINK4 = 900 * GB             # vendor datasheet (H100 / H200 / H20 SXM)

PRESETS: dict[str, HardwarePreset] = {p.name: p for p in (
    HardwarePreset("a10", 125, 600 * GiB, 24 * GiB, "pcie", PCIE4_X8 * 0.9, PCIE4_X8, PCIE4_X8,
                   "Seesaw Table 1 (all-reduce: 0.9 x PCIe 4.0 x8, assumed)"),
    HardwarePreset("l4", 121, 300 * GiB, 24 * GiB, "pcie", PCIE4_X8 * 0.9, PCIE4_X8, PCIE4_X8,
                   "Seesaw Table 1 (all-reduce: 0.9 x PCIe 4.0 x8, assumed)"),
    HardwarePreset("l20", 119.5, 864 * GB, 48 * GB, "pcie", 14.65 * GB, 20.79 * GB, PCIE4_X16,
                   "TD-Pipe Table 1; p2p: gLLM §5.1"),
    HardwarePreset("a100-pcie", 312, 1935 * GB, 80 * GB, "pcie", 14.82 * GB, 20.79 * GB,
                   PCIE4_X16, "TD-Pipe Table 1 (A100 80GB PCIe); p2p as gLLM's PCIe nodes"),
    HardwarePreset("a100-sxm", 312, 1555 * GiB, 40 * GiB, "nvlink", NVLINK3 * 0.5, NVLINK3 * 0.5,
                   PCIE4_X16, "Seesaw Table 1 (A100 40GB, NVLink 600 GiB/s; half of it as achieved)"),
    HardwarePreset("h100", 989, 3350 * GB, 80 * GB, "nvlink", NVLINK4 * 0.5, NVLINK4 * 0.5,
                   PCIE5_X16, "vendor datasheet (H100 SXM 80GB; SiPipe's testbed)"),
    HardwarePreset("h20", 148, 4000 * GB, 144 * GB, "nvlink", NVLINK4 * 0.5, NVLINK4 * 0.5,
                   PCIE5_X16, "memory: SiDP Table 1; FLOPS, bandwidth: vendor datasheet"),
    HardwarePreset("h200", 989, 4800 * GB, 144 * GB, "nvlink", NVLINK4 * 0.5, NVLINK4 * 0.5,
                   PCIE5_X16, "memory: SiDP Table 1; FLOPS, bandwidth: vendor datasheet"),
)}

COMPUTE_EFFICIENCY = 0.6       # achieved share of the tensor-core peak in large GEMMs
MEMORY_EFFICIENCY = 0.8        # achieved share of the memory bandwidth
LAYER_OVERHEAD_S = 20e-6       # kernel launches and small ops per decoder layer
LINK_LATENCY_S = 20e-6         # per p2p transfer / all-reduce step
SAMPLING_PASSES = 4            # softmax, top-k/p and friends read the logits a few times
HOST_SAMPLING_BANDWIDTH = 20 * GB   # what one CPU sampler process streams (DDR5 host, assumed)
CONTROLLER_PER_STEP_S = 1e-3   # this engine's Python controller per micro-batch
CONTROLLER_PER_SEQ_S = 5e-6


def preset(name: str) -> HardwarePreset:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware preset {name!r}; known: "
                         f"{', '.join(sorted(PRESETS))}") from None


class RooflineCostModel:
    """The CostModel protocol (sim/cost_model.py) for `arch` on a hardware preset."""

    def __init__(self, hardware: HardwarePreset, arch, dtype_bytes: int = 2):
        self.hardware, self.arch, self.dtype_bytes = hardware, arch, dtype_bytes
        self.num_layers = arch.num_layers
        self.kv_bytes_per_token = arch.kv_bytes_per_token(dtype_bytes)
        self.logits_bytes = 4 * arch.vocab_size
        self.device, self.memory_bytes = "cuda", int(hardware.memory)
        h, i = arch.hidden_size, arch.intermediate_size
        self.layer_params = h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h + 3 * h * i
        self.peak_flops = hardware.tflops * 1e12 * COMPUTE_EFFICIENCY
        self.bandwidth = hardware.memory_bandwidth * MEMORY_EFFICIENCY
        self.p2p = LinkCost(LINK_LATENCY_S, hardware.p2p_bandwidth)
        self.allreduce = LinkCost(LINK_LATENCY_S * 6, hardware.allreduce_bandwidth, ranks=4)

    def _roofline(self, flops: float, nbytes: float) -> float:
        return max(flops / self.peak_flops, nbytes / self.bandwidth)

    def layer_seconds(self, shape: BatchShape, tp: int) -> float:
        arch = self.arch
        kv_per_token_layer = 2 * arch.kv_size * self.dtype_bytes
        attn_pairs = shape.decode_context + shape.prefill_pairs
        flops = (2 * self.layer_params * shape.tokens + 4 * attn_pairs * arch.q_size) / tp
        nbytes = (self.layer_params * self.dtype_bytes
                  + shape.decode_context * kv_per_token_layer) / tp
        return self._roofline(flops, nbytes) + LAYER_OVERHEAD_S

    def head_seconds(self, rows: int, tp: int) -> float:
        """The final norm and LM head for `rows` sampled rows."""
        if rows <= 0:
            return 0.0
        v, h = self.arch.vocab_size, self.arch.hidden_size
        return self._roofline(2 * v * h * rows / tp, v * h * self.dtype_bytes / tp)

    def sample_seconds(self, rows: int, bandwidth: float = 0.0) -> float:
        """The sampler: a few passes over the fp32 logits (on the GPU, or at `bandwidth`)."""
        if rows <= 0:
            return 0.0
        return (SAMPLING_PASSES * rows * self.logits_bytes / (bandwidth or self.bandwidth)
                + LAYER_OVERHEAD_S)

    def cpu_sample_seconds(self, rows: int) -> float:
        """One of SiPipe's CPU sampler processes."""
        return self.sample_seconds(rows, HOST_SAMPLING_BANDWIDTH)

    # --- the CostModel protocol -------------------------------------------------------------------
    def stage_seconds(self, shape: BatchShape, layers: int, last: bool, tp: int,
                      threads: int, sample: bool = True) -> float:
        seconds = layers * self.layer_seconds(shape, tp)
        if tp > 1:
            nbytes = shape.tokens * self.arch.hidden_size * self.dtype_bytes
            seconds += 2 * layers * self.allreduce.allreduce_seconds(nbytes, tp)
        if last:
            seconds += self.head_seconds(shape.sample_rows, tp)
            if sample:
                seconds += self.sample_seconds(shape.sample_rows)
        return seconds

    def transfer_seconds(self, tokens: int) -> float:
        nbytes = ACTIVATIONS_PER_TOKEN * tokens * self.arch.hidden_size * self.dtype_bytes
        return self.p2p.seconds(nbytes)

    def controller_seconds(self, seqs: int) -> float:
        return CONTROLLER_PER_STEP_S + CONTROLLER_PER_SEQ_S * seqs

    def host_copy_seconds(self, nbytes: float) -> float:
        return LINK_LATENCY_S + nbytes / self.hardware.host_bandwidth

    def ffn_seconds(self, tokens: int, threads: int) -> float:
        h, i = self.arch.hidden_size, self.arch.intermediate_size
        return self._roofline(6 * h * i * tokens, 3 * h * i * self.dtype_bytes) + LAYER_OVERHEAD_S

    def weight_read_seconds(self, nbytes: float) -> float:
        """A peer GPU's weights over the interconnect (SiDP's WaS)."""
        return self.p2p.seconds(nbytes)

    def p2p_seconds(self, nbytes: float) -> float:
        return self.p2p.seconds(nbytes)
