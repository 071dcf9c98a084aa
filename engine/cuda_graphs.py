"""CUDA graphs for decode steps, as vLLM captures them (on by default with the Triton attention).

On a GPU, a decode step of a small model is mostly kernel launches: SmolLM2's 30 layers launch
~1,450 kernels, each with a few microseconds of host time, which at short contexts is more than
the GPU work they start (benchmarks/engine/cuda_step_profile.py). A CUDA graph records the forward's
launches once, and each later step replays them with one call.

A graph fixes every shape and every address, so:
- the batch is padded up to a captured size (BATCH_SIZES: 1, 2, 4, then multiples of 8, as vLLM
  captures), and every block table up to a captured width (`width_bucket`: at most 1/8 more
  blocks); the step copies its inputs into static buffers. Padding is work the GPU does for
  nothing where attention gathers the padded tables (the torch path): power-of-two widths made
  a ShareGPT run 13% slower than eager. The Triton kernel reads each row only up to its length,
  so there the padded width costs nothing, which is why graphs are on by default with it;
- the attention is the Triton paged kernel (triton_attention.py), or with the torch backend
  torch_attention's decode rows (`decode_attention`) over the padded tables, with the mask built
  inside the graph from the lengths;
- padding rows write their K/V into one block reserved for them (held in the block manager under
  PADDING_OWNER, one block even with layer groups: every group's padding K/V goes there; in a
  worker process the block past the scheduler's pool, runtime/worker_graphs.py), never into a
  sequence's block;
- with KV layer groups (kv_groups.py) each group after the first has its own static slot blocks
  and tables, and its layers attend through them (`StaticDecodeMeta.groups`).

With the Triton kernel the width is always the largest, so there is one graph per batch size,
and all of them are captured when the engine is built (`capture_all`, as vLLM does); with the
torch path a graph is captured the first time its (batch, width) shape is needed. All share one
memory pool. That is safe because steps replay one at a time and each step's outputs are consumed before
the next replay. Only pure-decode batches on one device use graphs; steps with prefill run eagerly,
and so do contexts longer than `max_seq_len_to_capture`.
With `capture=False` the same padded forward runs eagerly: the tests run it on CPU.
"""
from __future__ import annotations

import copy
import logging
import time
from bisect import bisect_left
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from .host_to_device import copy_into
from .kv_cache import BlockManager
from .step_plan import StepPlan
from .torch_attention import decode_attention, write_kv

log = logging.getLogger(__name__)

# the batch sizes captured: every decode batch runs padded to the next one (vLLM's sizes to 512)
BATCH_SIZES = (1, 2, 4, *range(8, 513, 8), *range(576, 1025, 64))
PADDING_OWNER = "__cuda_graph_padding__"


def batch_sizes_up_to(max_batch: int) -> list[int]:
    """The captured sizes a scheduler allowing max_batch sequences can need (batches larger
    than BATCH_SIZES' last run eagerly)."""
    sizes = [s for s in BATCH_SIZES if s < max_batch]
    return sizes + [s for s in BATCH_SIZES if s >= max_batch][:1]


def width_bucket(blocks: int) -> int:
    """Block-table width a graph is captured for: exact up to 8 blocks, then rounded up to a
    multiple of 1/8 of the power of two below (at most 12.5% padding)."""
    if blocks <= 8:
        return max(1, blocks)
    step = 1 << (blocks.bit_length() - 4)
    return -(-blocks // step) * step


class StaticDecodeMeta:
    """What write_kv and the attention read in one graph: views of the static input buffers."""

    def __init__(self, ints: torch.Tensor, tables: torch.Tensor, block_size: int,
                 work: torch.Tensor, query_start: torch.Tensor):
        self.slot_blocks, self.slot_offsets, self.seq_lens = ints[2], ints[3], ints[4]
        self.tables = tables
        self.work, self.query_start = work, query_start   # the Triton kernel's: row i, one query
        self.key_pos = torch.arange(tables.shape[1] * block_size, device=tables.device)
        self.mask: Optional[torch.Tensor] = None   # built by prepare() (the torch path's)
        self.groups: tuple = ()     # KV layer groups 1..: the same views over their own tables

    def for_group(self, slot_blocks: torch.Tensor, tables: torch.Tensor) -> "StaticDecodeMeta":
        other = copy.copy(self)
        other.slot_blocks, other.tables, other.groups = slot_blocks, tables, ()
        return other

    def prepare(self, masked: bool) -> None:
        """The torch path's attention mask from the lengths; runs inside the graph, once for all
        layers (the Triton kernel reads the lengths itself)."""
        if masked:
            self.mask = (self.key_pos[None, :] < self.seq_lens[:, None])[:, None, None, :]
            for group in self.groups:
                group.mask = self.mask


class GraphDecodeAttention:
    """Decode attention over a padded block table, with no host work: capturable. `triton`:
    the paged kernel (triton_attention.py), which reads each row's keys up to its length only,
    so the padded width costs nothing; else torch_attention's gather + SDPA under a mask."""

    name = "cuda_graph"
    write_kv = staticmethod(write_kv)

    def __init__(self, triton: bool = False):
        self.triton = triton

    def attend(self, q, key_cache, value_cache, meta: StaticDecodeMeta, scale: float,
               window: int = 0, softcap: float = 0.0, sinks=None) -> torch.Tensor:
        if not self.triton:
            mask = meta.mask
            if window:   # a sliding-window layer: the row's last `window` keys
                recent = meta.key_pos[None, :] >= meta.seq_lens[:, None] - window
                mask = mask & recent[:, None, None, :]
            return decode_attention(q, key_cache, value_cache, meta.tables, mask, scale, softcap,
                                    sinks)
        from .triton_attention import launch

        out = torch.empty_like(q)
        launch(out, q, key_cache, value_cache, meta.tables, meta.seq_lens, meta.query_start,
               meta.work, q.shape[0], True, scale, window, softcap, sinks)
        return out


class _Graph:
    """One captured shape: replay() runs it and returns its static (hidden, residual)."""

    def __init__(self, forward: Callable, graph: Optional["torch.cuda.CUDAGraph"], outputs):
        self.forward, self.graph, self.outputs = forward, graph, outputs

    def replay(self):
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.outputs


class GraphStep(NamedTuple):
    """A step staged into a graph's static inputs (DecodeGraphs.stage): replay runs it."""

    graph: "_Graph"
    rows: torch.Tensor              # the logits rows: the step's own, before the padding


class DecodeGraphs:
    """Runs pure-decode steps of a single-device model through captured CUDA graphs.

    `share_pool_with`: another DecodeGraphs over the same model whose graphs' memory pool these
    graphs share (a worker's two input versions, runtime/worker_graphs.py): safe while steps
    replay one at a time on one stream and each step's outputs are read before the next."""

    def __init__(self, model, kv_caches: list, block_manager: BlockManager, device: torch.device,
                 max_batch: int, max_seq_len_to_capture: int, capture: bool = True,
                 triton_attention: bool = False,
                 share_pool_with: Optional["DecodeGraphs"] = None, lazy: bool = True):
        self.model, self.kv_caches, self.block_manager = model, kv_caches, block_manager
        self.device, self.capture = device, capture
        self.lazy = lazy        # false: a shape not captured yet runs eagerly (never captured
                                # here: stage may run on a thread beside the forward's)
        self.block_size = block_manager.block_size
        self.sizes = batch_sizes_up_to(max_batch)
        self.max_width = width_bucket(max(1, max_seq_len_to_capture // self.block_size))
        biggest = self.sizes[-1]
        # rows: token ids, positions, slot blocks, slot offsets, sequence lengths
        self._ints = torch.zeros(5, biggest, dtype=torch.long, device=device)
        self._tables = torch.zeros(biggest, self.max_width, dtype=torch.long, device=device)
        # KV layer groups after the first: their slot blocks and tables
        groups = block_manager.num_groups - 1
        self._group_slots = torch.zeros(groups, biggest, dtype=torch.long, device=device)
        self._group_tables = torch.zeros(groups, biggest, self.max_width, dtype=torch.long,
                                         device=device)
        self._rows = torch.arange(biggest, dtype=torch.long, device=device)
        # the Triton kernel's static work list (row i: sequence i, its one query) and query starts
        self._work = torch.stack([self._rows, torch.zeros_like(self._rows)], 1).to(torch.int32)
        self._query_start = torch.arange(biggest + 1, dtype=torch.int32, device=device)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        # [the memory pool of the first graph captured], shared with `share_pool_with`
        self._pool: list = share_pool_with._pool if share_pool_with is not None else [None]
        self._pad_block: Optional[int] = None
        self.attention = GraphDecodeAttention(triton_attention)
        self.steps = 0              # steps run through a graph
        self.capture_seconds = 0.0

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, plan: StepPlan, substitute: Optional[Callable[[torch.Tensor], None]] = None):
        """-> (hidden, residual, logits rows) for a pure-decode plan that fits a graph, else None
        (the caller runs the step eagerly). substitute(input ids): writes the ids still on the
        device into the static buffer (async scheduling), after the host's copy."""
        step = self.stage(plan)
        if step is None:
            return None
        if substitute is not None:
            substitute(self._ints[0, :len(step.rows)])
        return (*self.replay(step), step.rows)

    def stage(self, plan: StepPlan) -> Optional[GraphStep]:
        """Writes a pure-decode plan that fits a graph into the static inputs (capturing its
        graph first if it has none yet); None: the step runs eagerly."""
        n = len(plan.query_lens)
        if n == 0 or n > self.sizes[-1] or len(plan.sample_items) != n or plan.lora_slots:
            return None       # (a LoRA adapter's tokens: its groups change step to step)
        if any(q != 1 for q in plan.query_lens):
            return None
        blocks = max(len(t) for t in plan.block_tables)
        # the Triton kernel reads a row's table only up to its length: one width serves every
        # step (a graph per batch size), and only the step's own columns need filling
        width = self.max_width if self.attention.triton else width_bucket(blocks)
        if blocks > self.max_width or not self._reserve_padding_block():
            return None
        batch = self.sizes[bisect_left(self.sizes, n)]
        graph = self._graphs.get((batch, width))
        if graph is None:
            if self.capture and not self.lazy:
                return None
            graph = self._capture(batch, width)
        self._fill(plan, batch, blocks if self.attention.triton else width)
        return GraphStep(graph, self._rows[:n])

    def replay(self, step: GraphStep):
        """-> (hidden, residual) of a staged step: the graph's static outputs."""
        hidden, residual = step.graph.replay()
        self.steps += 1
        return hidden, residual

    # --- inputs ---------------------------------------------------------------------------------
    def _reserve_padding_block(self) -> bool:
        """One block for the padding rows' K/V (every layer group's: one page, whatever the
        number of groups, BlockManager.reserve_block); False when none is free."""
        if self._pad_block is None:
            self._pad_block = self.block_manager.reserve_block(PADDING_OWNER)
        return self._pad_block is not None

    def _fill(self, plan: StepPlan, batch: int, width: int) -> None:
        """The step's inputs into the static buffers, padding rows after the step's own. Built in
        numpy, row by row: a nested list through torch.tensor took ~10 us a sequence."""
        bs, pad, n = self.block_size, self._pad_block, len(plan.seq_lens)
        ints = np.zeros((5, batch), dtype=np.int64)
        ints[0, :n] = plan.input_ids
        ints[4, :n] = plan.seq_lens
        positions = ints[4, :n] - 1
        ints[1, :n] = positions
        ints[2, :n] = [t[p // bs] for t, p in zip(plan.block_tables, positions.tolist())]
        ints[3, :n] = positions % bs
        ints[2, n:], ints[4, n:] = pad, 1
        tables = np.full((batch, width), pad, dtype=np.int64)
        for row, table in enumerate(plan.block_tables):
            tables[row, :len(table)] = table
        copy_into(self._ints[:, :batch], torch.from_numpy(ints))
        copy_into(self._tables[:batch, :width], torch.from_numpy(tables))
        if plan.group_tables:
            slots = np.full((len(plan.group_tables), batch), pad, dtype=np.int64)
            tables = np.full((len(plan.group_tables), batch, width), pad, dtype=np.int64)
            for group, group_tables in enumerate(plan.group_tables):
                slots[group, :n] = [t[p // bs] for t, p in zip(group_tables, positions.tolist())]
                for row, table in enumerate(group_tables):
                    tables[group, row, :len(table)] = table
            copy_into(self._group_slots[:, :batch], torch.from_numpy(slots))
            copy_into(self._group_tables[:, :batch, :width], torch.from_numpy(tables))

    def _padding_inputs(self, batch: int, width: int) -> None:
        """Every row a padding row: warm-up and capture write only the padding block."""
        self._ints[:, :batch] = torch.tensor([0, 0, self._pad_block, 0, 1], device=self.device)[:, None]
        self._tables[:batch, :width] = self._pad_block
        self._group_slots[:, :batch] = self._pad_block
        self._group_tables[:, :batch, :width] = self._pad_block

    # --- capture --------------------------------------------------------------------------------
    def capture_all(self) -> None:
        """Every batch size's graph before the first request (largest first, so the smaller ones
        reuse its memory pool), as vLLM captures at start: captured lazily, they cost a W-8B run
        on an H100 5.0 of its 33 s. Only with the Triton kernel, whose graphs all take the one
        largest width; the torch path's widths follow the contexts and stay lazy."""
        if not (self.capture and self.attention.triton) or not self._reserve_padding_block():
            return
        start = time.perf_counter()
        for batch in reversed(self.sizes):
            if (batch, self.max_width) not in self._graphs:
                self._capture(batch, self.max_width, announce=False)
        log.info("CUDA graphs for %d batch sizes (1-%d sequences, up to %d tokens each) "
                 "captured in %.1f s", len(self.sizes), self.sizes[-1],
                 self.max_width * self.block_size, time.perf_counter() - start)

    def _capture(self, batch: int, width: int, announce: bool = True) -> _Graph:
        start = time.perf_counter()
        ints = self._ints[:, :batch]
        meta = StaticDecodeMeta(ints, self._tables[:batch, :width], self.block_size,
                                self._work[:batch], self._query_start[:batch + 1])
        meta.groups = tuple(meta.for_group(slots[:batch], tables[:batch, :width])
                            for slots, tables in zip(self._group_slots, self._group_tables))

        def forward():
            meta.prepare(masked=not self.attention.triton)
            return self.model(ints[0], ints[1], self.kv_caches, meta, self.attention)

        self._padding_inputs(batch, width)
        if not self.capture:
            graph = _Graph(forward, None, None)
        else:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):     # warm-up: lazy inits and the allocator outside the capture
                    forward()
            torch.cuda.current_stream(self.device).wait_stream(side)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph, pool=self._pool[0]):
                outputs = forward()
            self._pool[0] = cuda_graph.pool()
            graph = _Graph(forward, cuda_graph, outputs)
        self._graphs[(batch, width)] = graph
        seconds = time.perf_counter() - start
        self.capture_seconds += seconds
        (log.info if announce else log.debug)(
            "decode graph for %d sequences, block tables of %d (%d tokens): %s in %.2f s",
            batch, width, width * self.block_size, "captured" if self.capture else "built (eager)",
            seconds)
        return graph
