"""CUDA graphs in a worker process: two graphs per batch size, one bound to each version of
token-safe execution's input buffers (arXiv:2506.22033 §5.2, Fig. 6).

Token-safe execution (input_prep.py) prepares iteration i + 1 on its own thread while the
forward runs iteration i, writing into the other of two input versions. A CUDA graph reads its
inputs from fixed addresses, so one graph per batch size could not be filled for i + 1 while
it replays i: as the paper does, each version has its own static buffers and its own graphs
(engine/cuda_graphs.py's DecodeGraphs, one per version, sharing one memory pool), the
preparation thread stages a pure-decode plan into version v's buffers, and the forward replays
version v's graph. The handshake's guarantee (version v is written for iteration i + 1 only
after the forward has taken iteration i, and the forward runs iterations in order on one
stream) is what keeps a replay from reading buffers being rewritten: the staging copies are
issued on the same stream after the replay that last read them.

Where graphs run: a worker that holds the whole model (one rank: no stage input to receive, no
tensor-parallel collective inside the graph), with token-safe inputs, on CUDA with the Triton
attention (every graph is captured at start, at the one widest block table, as the
single-process engine does; the torch path's graphs are captured lazily, which would happen
on the preparation thread: a shape not captured at start runs eagerly, `lazy=False`)
and
`device.cuda_graphs` not off. Steps with prefill, batches larger than the largest captured
size and contexts past `device.max_seq_len_to_capture` run eagerly. The staging copies go on
the stream the forward runs on (taken when the graphs are built), whichever stream the
preparation thread would otherwise use. Each version keeps its own graphs' static outputs, so
the graphs' memory beside the KV cache is about twice the single-process engine's. The padding rows write their K/V into one
block past the scheduler's pool (the worker allocates num_blocks + 1), so the controller's
block manager is untouched. `capture: false` (tests) runs the same padded forward eagerly on
CPU.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..cuda_graphs import DecodeGraphs, GraphStep
from ..step_plan import ModelInputs, StepPlan


@dataclass(frozen=True)
class WorkerGraphSpec:
    """What the controller tells a worker about its decode graphs (WorkerSpec.decode_graphs)."""

    max_batch: int          # the scheduler's max_num_seqs: the largest batch size captured
    max_seq_len: int        # device.max_seq_len_to_capture (at most max_model_len)
    capture: bool = True    # false: the padded forward runs eagerly (CPU tests)


@dataclass(frozen=True)
class GraphInputs:
    """A plan staged into version `version`'s graph inputs (what the forward replays)."""

    version: int
    step: GraphStep

    @property
    def logits_rows(self) -> torch.Tensor:
        return self.step.rows


class _PaddingBlock:
    """The block-manager face DecodeGraphs reads in a worker: the block size, the layer groups,
    and the padding block (the one past the scheduler's pool)."""

    def __init__(self, block_size: int, num_groups: int, block: int):
        self.block_size, self.num_groups, self.block = block_size, num_groups, block

    def reserve_block(self, owner) -> int:
        return self.block


class WorkerGraphs:
    def __init__(self, spec: WorkerGraphSpec, model, kv_caches: list, device: torch.device,
                 block_size: int, num_groups: int, padding_block: int, triton: bool):
        padding = _PaddingBlock(block_size, num_groups, padding_block)
        first = DecodeGraphs(model, kv_caches, padding, device, spec.max_batch, spec.max_seq_len,
                             capture=spec.capture, triton_attention=triton, lazy=False)
        self.versions = (first, DecodeGraphs(model, kv_caches, padding, device, spec.max_batch,
                                             spec.max_seq_len, capture=spec.capture,
                                             triton_attention=triton, share_pool_with=first,
                                             lazy=False))
        # the forward's stream: the staging copies are ordered on it after the replays before
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def capture_all(self) -> None:
        """Both versions' graphs, every batch size (the Triton path; no-op otherwise)."""
        for graphs in self.versions:
            graphs.capture_all()

    def preparer(self, eager: Callable[[int, StepPlan], ModelInputs]
                 ) -> Callable[[int, StepPlan], object]:
        """token-safe execution's prepare(version, plan): a pure-decode plan that fits a graph
        is staged into that version's graph inputs, any other goes to `eager` (the versioned
        buffers of the eager forward)."""
        def prepare(version: int, plan: StepPlan):
            with (torch.cuda.stream(self.stream) if self.stream is not None
                  else contextlib.nullcontext()):
                step = self.versions[version].stage(plan)
                return GraphInputs(version, step) if step is not None else eager(version, plan)
        return prepare

    def forward(self, inputs: GraphInputs):
        """-> (hidden, residual): the staged version's graph replayed (its static outputs, read
        before the next replay on the stream)."""
        return self.versions[inputs.version].replay(inputs.step)
