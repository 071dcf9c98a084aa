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
roofline) and this engine's default sampler: its host work before the kernels, then what its
portable kernels move through the GPU's memory plus a launch each. Every stage prepares its
model inputs on the host before its forward (with SiPipe's token-safe execution, on a thread of
its own, ahead of the forward when the plan reaches the worker in time: sim/executor.py). Host
copies (Seesaw's KV tier and weight reloads, SiPipe's logits) go over the
preset's PCIe link to the host. Efficiencies and overheads are stated assumptions, the same for
every preset, so rankings come from the specs; the host-side costs are this engine's, measured
on the project's 2-core CPU host (benchmarks/sim/host_costs.py), and the GPU hosts' cores are assumed
to run them as fast.
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
KERNEL_LAUNCH_S = 5e-6         # one eager PyTorch op's dispatch and launch (assumed)

# Measured by `python benchmarks/sim/host_costs.py --repeats 21` (2026-11-24, the project's 2-core
# AVX2 host; two runs, their fits averaged).
INPUT_PREP_PER_STEP_S = 2.1e-4      # a StepPlan into the versioned input buffers
INPUT_PREP_PER_SEQ_S = 2.7e-6
INPUT_PREP_PER_BLOCK_S = 8e-8       # per block-table entry (rows x the widest table)
INPUT_PREP_PER_TOKEN_S = 5.4e-7     # per query token (ids, positions, slots)
INPUT_BLOCK_SIZE = 16               # the engine's default block size (block-table entries)
SAMPLER_PREPARE_PER_ROW_S = 1.15e-5  # Sampler.prepare: per-row parameters
SAMPLER_PREPARE_PER_PENALTY_TOKEN_S = 2.3e-9   # ... copying the kept tokens of penalty rows
SAMPLER_BYTES_PER_LOGIT = {"greedy": 12.0, "full": 340.0}   # portable kernels' memory traffic
SAMPLER_KERNELS = {"greedy": 2, "full": 61}                  # ... and their op count
COLUMN_SAMPLER_S_PER_LOGIT = 4.3e-9  # SiPipe's column-wise sampler, one thread, every knob on
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
        self.memory_is_card = True
        self.attn_params = arch.hidden_size * (2 * arch.q_size + 2 * arch.kv_size)
        self.peak_flops = hardware.tflops * 1e12 * COMPUTE_EFFICIENCY
        self.bandwidth = hardware.memory_bandwidth * MEMORY_EFFICIENCY
        self.p2p = LinkCost(LINK_LATENCY_S, hardware.p2p_bandwidth)
        self.allreduce = LinkCost(LINK_LATENCY_S * 6, hardware.allreduce_bandwidth, ranks=4)

    def _roofline(self, flops: float, nbytes: float) -> float:
        return max(flops / self.peak_flops, nbytes / self.bandwidth)

    def ffn_work(self, tokens: int) -> tuple[float, float]:
        """(FLOPs, weight bytes) of one layer's feed-forward over `tokens` tokens, averaged over
        the model's layers. A dense MLP reads all its weights and runs them for every token. A
        mixture of experts runs each token through its top_k experts (plus the router and any
        shared expert) and reads only the experts some token was routed to: with routing taken
        as uniform, E (1 - (1 - k/E)^T) distinct experts of E for T tokens (a decode step of
        a few sequences reads a few experts; a long prefill, all of them)."""
        arch = self.arch
        h = arch.hidden_size
        dense = 3 * h * arch.intermediate_size
        moe = arch.moe
        if moe is None:
            return 2.0 * dense * tokens, float(dense * self.dtype_bytes)
        expert = 3 * h * moe.intermediate_size
        always = h * moe.num_experts + (3 * h * moe.shared_intermediate_size + h
                                        if moe.shared_intermediate_size else 0)
        touched = moe.num_experts * (1.0 - (1.0 - moe.top_k / moe.num_experts) ** tokens)
        sparse_flops = 2.0 * (moe.top_k * expert + always) * tokens
        sparse_bytes = (touched * expert + always) * self.dtype_bytes
        share = moe.num_sparse_layers / arch.num_layers
        return (share * sparse_flops + (1 - share) * 2.0 * dense * tokens,
                share * sparse_bytes + (1 - share) * dense * self.dtype_bytes)

    def layer_seconds(self, shape: BatchShape, tp: int) -> float:
        arch = self.arch
        kv_per_token_layer = 2 * arch.kv_size * self.dtype_bytes
        attn_pairs = shape.decode_context + shape.prefill_pairs
        ffn_flops, ffn_bytes = self.ffn_work(shape.tokens)
        flops = (2 * self.attn_params * shape.tokens + ffn_flops
                 + 4 * attn_pairs * arch.q_size) / tp
        nbytes = (self.attn_params * self.dtype_bytes + ffn_bytes
                  + shape.decode_context * kv_per_token_layer) / tp
        return self._roofline(flops, nbytes) + LAYER_OVERHEAD_S

    def head_seconds(self, rows: int, tp: int) -> float:
        """The final norm and LM head for `rows` sampled rows."""
        if rows <= 0:
            return 0.0
        v, h = self.arch.vocab_size, self.arch.hidden_size
        return self._roofline(2 * v * h * rows / tp, v * h * self.dtype_bytes / tp)

    def sample_seconds(self, shape: BatchShape) -> float:
        """The default sampler on the GPU for the shape's sampled rows: its host work
        (Sampler.prepare), then its portable kernels (memory traffic and launches); greedy-only
        batches take the argmax path."""
        rows = shape.sample_rows
        if rows <= 0:
            return 0.0
        kind = "full" if shape.random_rows or shape.penalty_tokens else "greedy"
        host = (SAMPLER_PREPARE_PER_ROW_S * rows
                + SAMPLER_PREPARE_PER_PENALTY_TOKEN_S * shape.penalty_tokens)
        device = (SAMPLER_BYTES_PER_LOGIT[kind] * rows * self.arch.vocab_size / self.bandwidth
                  + SAMPLER_KERNELS[kind] * KERNEL_LAUNCH_S)
        return host + device

    def cpu_sample_seconds(self, rows: int, threads: int = 1) -> float:
        """One of SiPipe's CPU sampler processes (column-wise, incremental) on `threads` cores."""
        if rows <= 0:
            return 0.0
        return COLUMN_SAMPLER_S_PER_LOGIT * rows * self.arch.vocab_size / max(threads, 1)

    def input_prep_seconds(self, shape: BatchShape) -> float:
        """A rank turning the step's plan into its model inputs, on the host (the block tables
        padded to the longest sequence's)."""
        blocks = shape.seqs * -(-shape.max_seq_len // INPUT_BLOCK_SIZE)
        return (INPUT_PREP_PER_STEP_S + INPUT_PREP_PER_SEQ_S * shape.seqs
                + INPUT_PREP_PER_BLOCK_S * blocks + INPUT_PREP_PER_TOKEN_S * shape.tokens)

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
                seconds += self.sample_seconds(shape)
        return seconds

    def transfer_seconds(self, tokens: int) -> float:
        nbytes = ACTIVATIONS_PER_TOKEN * tokens * self.arch.hidden_size * self.dtype_bytes
        return self.p2p.seconds(nbytes)

    def controller_seconds(self, seqs: int) -> float:
        return CONTROLLER_PER_STEP_S + CONTROLLER_PER_SEQ_S * seqs

    def host_copy_seconds(self, nbytes: float) -> float:
        return LINK_LATENCY_S + nbytes / self.hardware.host_bandwidth

    def ffn_seconds(self, tokens: int, threads: int) -> float:
        return self._roofline(*self.ffn_work(tokens)) + LAYER_OVERHEAD_S

    def weight_read_seconds(self, nbytes: float) -> float:
        """A peer GPU's weights over the interconnect (SiDP's WaS)."""
        return self.p2p.seconds(nbytes)

    def p2p_seconds(self, nbytes: float) -> float:
        return self.p2p.seconds(nbytes)
