"""What the simulator asks of a cost model, and the one that reads a measured profile table.

A micro-batch is reduced to its `BatchShape` (token and sequence counts, the context its decode
queries read, the query x key pairs of its prefill chunks, the rows that sample). A cost model
prices one pipeline stage running that shape over its layers (`stage_seconds`), the activations a
stage hands the next one (`transfer_seconds`), the controller's own work per step, a rank's
input preparation before its forward, copies
between device and host memory (Seesaw), a CPU sampler's work (SiPipe), and SiDP's pieces: one
layer's FFN alone, a remote FFN layer's weights read into a weight slot, a point-to-point message.
Two implementations: `MeasuredCostModel` (a profile of this machine, sim/profile_table.py) and
`RooflineCostModel` (a hardware preset, sim/hardware.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from batchinfer.engine.scheduler import MicroBatch
from batchinfer.engine.step_times import interpolate

from .profile_table import ProfileTable

# what a stage hands the next one per token: the hidden state and the residual
ACTIVATIONS_PER_TOKEN = 2


@dataclass(frozen=True)
class BatchShape:
    tokens: int
    seqs: int
    decode_seqs: int
    decode_context: int       # sum of the context lengths that decode queries read
    prefill_pairs: float      # sum over prefill chunks of query x key pairs (causal)
    sample_rows: int
    random_rows: int = 0      # sampled rows that are not greedy (temperature > 0)
    penalty_tokens: int = 0   # the penalty rows' padded prompt + output tokens (rows x longest)
    max_seq_len: int = 0      # the longest sequence after the step (the padded block tables)

    @classmethod
    def of(cls, batch: MicroBatch) -> "BatchShape":
        """Valid before the engine applies the step (it reads the sequences' progress)."""
        tokens = context = rows = decodes = random_rows = longest = 0
        penalty_rows = longest_prompt = longest_output = 0
        pairs = 0.0
        for item in batch.items:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            tokens += n
            longest = max(longest, start + n)
            if item.is_decode:
                decodes += 1
                context += start + 1
            else:
                pairs += n * (start + (n + 1) / 2)
            if item.samples:
                rows += 1
                sampling = seq.request.sampling
                if not sampling.greedy:
                    random_rows += 1
                if sampling.uses_penalties:
                    penalty_rows += 1
                    longest_prompt = max(longest_prompt, seq.prompt_len)
                    longest_output = max(longest_output, len(seq.output_token_ids))
        return cls(tokens, len(batch.items), decodes, context, pairs, rows, random_rows,
                   penalty_rows * (longest_prompt + longest_output), longest)


class CostModel(Protocol):
    num_layers: int
    kv_bytes_per_token: int                  # whole model
    logits_bytes: int                        # one row of logits (fp32)

    def stage_seconds(self, shape: BatchShape, layers: int, last: bool, tp: int,
                      threads: int, sample: bool = True) -> float: ...
    def cpu_sample_seconds(self, rows: int, threads: int = 1) -> float: ...
    def input_prep_seconds(self, shape: BatchShape) -> float: ...
    def transfer_seconds(self, tokens: int) -> float: ...
    def controller_seconds(self, seqs: int) -> float: ...
    def host_copy_seconds(self, nbytes: float) -> float: ...
    def ffn_seconds(self, tokens: int, threads: int) -> float: ...
    def weight_read_seconds(self, nbytes: float) -> float: ...
    def p2p_seconds(self, nbytes: float) -> float: ...

    # what the engine's KV budget reads (engine/build.py kv_budget): the device and its memory
    device: str                              # cpu | cuda
    memory_bytes: int                        # free memory of one device (host RAM on CPU)
    # memory_bytes is the whole card (a preset), not the room a measured run had for weights + KV
    memory_is_card: bool


def ffn_share(arch) -> float:
    """The FFN's share of a decoder layer's weights (and of its dense GEMM FLOPs)."""
    h, i = arch.hidden_size, arch.intermediate_size
    ffn = 3 * h * i
    return ffn / (h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h + ffn)


def cost_device(cost: CostModel) -> torch.device:
    """The device kind a cost model prices (the engine's KV budget rules differ by kind)."""
    return torch.device(cost.device)


class MeasuredCostModel:
    """Prices micro-batches from a profile of this machine (sim/profile_table.py)."""

    def __init__(self, table: ProfileTable):
        self.table = table
        self.num_layers = int(table.model["num_layers"])
        self.hidden_size = int(table.model["hidden_size"])
        # hidden states' element (fp32 on a CPU running bf16); tables before the profiler
        # recorded it: their dtype_bytes was it
        self.dtype_bytes = int(table.model.get("activation_dtype_bytes",
                                               table.model["dtype_bytes"]))
        self.kv_bytes_per_token = table.kv_bytes_per_token
        self.device = table.hardware.get("device", "cpu")
        self.memory_bytes = table.memory_available_bytes
        self.memory_is_card = False
        self.logits_bytes = 4 * int(table.model["vocab_size"])
        self._sampling_threads = min(table.compute)        # a sampler process: one thread

    def stage_seconds(self, shape: BatchShape, layers: int, last: bool, tp: int,
                      threads: int, sample: bool = True) -> float:
        """`layers` decoder layers (+ LM head, and the sampler unless `sample` is False, on the
        last stage). Under TP each rank does 1/tp of the layer's work (profiled at `threads` per
        rank) and two all-reduces of the micro-batch's hidden states per layer."""
        comp = self.table.rank_compute(threads)
        layer = comp.layer_seconds(shape.tokens, shape.seqs, shape.decode_seqs,
                                   shape.decode_context, shape.prefill_pairs)
        seconds = layers * layer / tp
        if tp > 1:
            nbytes = shape.tokens * self.hidden_size * self.dtype_bytes
            seconds += 2 * layers * self.table.allreduce.allreduce_seconds(nbytes, tp)
        if last and shape.sample_rows:
            seconds += interpolate(comp.lm_head, shape.sample_rows)
            if sample:
                seconds += interpolate(comp.sampling, shape.sample_rows)
        return seconds

    def cpu_sample_seconds(self, rows: int, threads: int = 1) -> float:
        """The sampler alone, on one thread (a SiPipe sampler process; the profile has the
        sampler at one thread only, so `threads` is not priced)."""
        return interpolate(self.table.rank_compute(self._sampling_threads).sampling, rows)

    def input_prep_seconds(self, shape: BatchShape) -> float:
        """Nothing on top of the forward: the profiled forward times (the in-process executor's
        forward_s) include building the model inputs."""
        return 0.0

    def transfer_seconds(self, tokens: int) -> float:
        nbytes = ACTIVATIONS_PER_TOKEN * tokens * self.hidden_size * self.dtype_bytes
        return self.table.p2p.seconds(nbytes)

    def controller_seconds(self, seqs: int) -> float:
        return self.table.controller_per_step_s + self.table.controller_per_seq_s * seqs

    def host_copy_seconds(self, nbytes: float) -> float:
        if self.table.host_copy is None:
            from batchinfer.engine.errors import ConfigError

            raise ConfigError("the profile table has no host copy bandwidth (made by an older "
                              "profiler); profile again")
        return self.table.host_copy.seconds(nbytes)

    def ffn_seconds(self, tokens: int, threads: int) -> float:
        """One layer's FFN over `tokens` rows: its weight share of the layer's dense term."""
        share = self.table.model.get("ffn_share")
        if share is None:
            from batchinfer.engine.errors import ConfigError

            raise ConfigError("the profile table does not say the model's FFN share (made by an "
                              "older profiler); profile again")
        return float(share) * interpolate(self.table.rank_compute(threads).layer_dense,
                                          max(tokens, 1))

    def weight_read_seconds(self, nbytes: float) -> float:
        """SiDP's slot fill: a copy from shared host memory on CPU, a peer read on GPUs."""
        return self.host_copy_seconds(nbytes) if self.device == "cpu" else self.p2p_seconds(nbytes)

    def p2p_seconds(self, nbytes: float) -> float:
        return self.table.p2p.seconds(nbytes)
