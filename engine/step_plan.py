"""A micro-batch as plain data: what every rank needs to run it, and nothing it can derive.

The controller turns a scheduled `MicroBatch` into a `StepPlan` (token ids, query and sequence
lengths, block tables, which rows sample); a worker (or the in-process executor) turns the plan
into tensors. Stages after the first already know the shape of the activations they will receive
from the plan (`num_tokens` x hidden size), so no per-step metadata travels with the tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .attention import GROUP_DTYPES, METADATA_DTYPES, AttentionMetadata, metadata_lists
from .host_to_device import packed_to_device
from .kv_cache import BlockManager
from .model.lora import lora_step
from .request import PENDING_TOKEN, Request
from .scheduler import MicroBatch


@dataclass
class StepPlan:
    mb_id: int
    input_ids: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_items: list[int]            # batch item index of each sampled row
    sample_request_ids: list[str]
    sample_output_lens: list[int]      # tokens each sampled request has generated so far
    new_requests: list[Request] = field(default_factory=list)  # first sight, for the sampling rank
    # async scheduling: (input position, row of the previous launch's sampled ids) for each input
    # token still on the device (PENDING_TOKEN in the sequence's outputs)
    pending: list[tuple[int, int]] = field(default_factory=list)
    released: list[str] = field(default_factory=list)          # finished since the last plan
    # KV layer groups (kv_groups.py): the block tables of groups 1.., [group][item]; block_tables
    # is group 0's. Empty with one table per sequence
    group_tables: list[list[list[int]]] = field(default_factory=list)
    # KV copies between the cache and the swap area to carry out before this plan's forward, in
    # order: (kind "out" | "in", source block, destination block) (kv_swap.py)
    kv_swaps: list[tuple[str, int, int]] = field(default_factory=list)
    # on the way to a worker: the tables as changes to what it holds (runtime/plan_deltas.py;
    # block_tables and group_tables are empty until the worker's cache fills them)
    table_deltas: Optional[object] = None
    # prompt positions the rank with the LM head scores (prompt_logprobs.py); None: none
    prompt_scores: Optional[list] = None
    # each item's LoRA adapter slot (model/lora.py); empty where no item uses an adapter
    lora_slots: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor       # rows of the hidden states that feed the sampler


def plan_batch(batch: MicroBatch, block_manager: BlockManager, mb_id: int = 0) -> StepPlan:
    """One pass over the batch; valid before the engine applies the step's results."""
    ids: list[int] = []
    query_lens, seq_lens, tables = [], [], []
    sample_items, sample_ids, output_lens = [], [], []
    pending: list[tuple[int, int]] = []
    groups: list[list[list[int]]] = [[] for _ in range(block_manager.num_groups - 1)]
    for index, item in enumerate(batch.items):
        seq, n = item.seq, item.num_tokens
        start = seq.num_computed_tokens
        prompt_len = seq.prompt_len
        if start + n <= prompt_len:
            ids.extend(seq.request.prompt_token_ids[start:start + n])
        elif n == 1 and start >= prompt_len:  # the usual decode step: just the last output token
            token = seq.output_token_ids[start - prompt_len]
            if token == PENDING_TOKEN:
                pending.append((len(ids), seq.pending_row))
            ids.append(token)
        else:
            ids.extend(seq.token_ids()[start:start + n])
        query_lens.append(n)
        seq_lens.append(start + n)
        tables.append(block_manager.block_table(seq.request_id))
        if groups:
            for group, table in zip(groups, block_manager.group_tables(seq.request_id)):
                group.append(table)
        if item.samples:
            sample_items.append(index)
            sample_ids.append(seq.request_id)
            output_lens.append(len(seq.output_token_ids))
    swaps = block_manager.swap.take_ops() if block_manager.swap is not None else []
    slots = [item.seq.request.lora_slot for item in batch.items]
    return StepPlan(mb_id, ids, query_lens, seq_lens, tables, sample_items, sample_ids, output_lens,
                    pending=pending, group_tables=groups, kv_swaps=swaps,
                    prompt_scores=batch.prompt_scores, lora_slots=slots if any(slots) else [])


def input_lists(plan: StepPlan, block_size: int) -> dict[str, list]:
    """Every model input of `plan` as a plain list: AttentionMetadata's fields, the token ids,
    their positions and the rows that feed the sampler."""
    positions: list[int] = []
    rows: list[int] = []
    sampled = set(plan.sample_items)
    end = 0
    for index, (q_len, s_len) in enumerate(zip(plan.query_lens, plan.seq_lens)):
        positions.extend(range(s_len - q_len, s_len))
        end += q_len
        if index in sampled:
            rows.append(end - 1)
    return {**metadata_lists(plan.query_lens, plan.seq_lens, plan.block_tables, block_size,
                             plan.group_tables),
            "input_ids": plan.input_ids, "positions": positions, "logits_rows": rows}


def model_inputs(plan: StepPlan, block_size: int, device: torch.device,
                 packed: Optional[bool] = None) -> ModelInputs:
    """The plan's tensors on `device`. packed (default: on CUDA): every field in one pinned,
    non-blocking copy (host_to_device.py) instead of one host-stalling copy per field."""
    lists = input_lists(plan, block_size)
    tables = lists["block_tables"]
    width = len(tables[0]) if tables else 1
    lists["block_tables"] = [block for row in tables for block in row]
    names = list(INPUT_DTYPES)
    if plan.group_tables:     # nested by group: flat here, shaped again on the device
        lists.update(flatten_groups(lists))
        names += list(GROUP_DTYPES)
    tensors = packed_to_device({name: lists[name] for name in names},
                               {**INPUT_DTYPES, **GROUP_DTYPES}, device, one_copy=packed)
    tensors["block_tables"] = tensors["block_tables"].view(len(tables), width)
    meta = AttentionMetadata(**{name: tensors[name] for name in METADATA_DTYPES},
                             query_lens_cpu=list(plan.query_lens),
                             seq_lens_cpu=list(plan.seq_lens))
    if plan.group_tables:
        groups = len(plan.group_tables)
        meta.with_groups(tensors["group_block_tables"].view(groups, len(tables), width),
                         tensors["group_slot_blocks"].view(groups, -1))
    meta.lora = lora_step(plan.lora_slots, plan.query_lens, device)
    return ModelInputs(tensors["input_ids"], tensors["positions"], meta, tensors["logits_rows"])


def flatten_groups(lists: dict) -> dict[str, list]:
    """GROUP_DTYPES' fields of input_lists, nested [group][...], as flat lists."""
    return {"group_block_tables": [block for tables in lists["group_block_tables"]
                                   for row in tables for block in row],
            "group_slot_blocks": [block for slots in lists["group_slot_blocks"]
                                  for block in slots]}


# every tensor of ModelInputs (the metadata's included) and its dtype
INPUT_DTYPES = {**METADATA_DTYPES, "input_ids": torch.long, "positions": torch.long,
                "logits_rows": torch.long}
