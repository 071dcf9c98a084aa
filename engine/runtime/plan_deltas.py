"""Plans that carry only the block-table entries a worker does not have yet (the SequenceCache of
arXiv:2506.22033 §5.2: each sequence's cached state on the worker, "minimizing redundant data
transfer when sequences are repeatedly scheduled").

Every plan goes to every rank of its replica over a pipe, and a decoding sequence's block table
changes once per block_size tokens; sent whole, the tables are most of a long-context plan's
bytes (256 sequences of 2,048 tokens: 100 of 107 KB pickled). Here the controller's encoder (one
per executor: all its plans reach the same ranks, in order) keeps a copy of the last table it
sent for each sequence, under a small integer handle, and sends per item how many entries of the
cached table stay and the entries after them: nothing at all while a table is unchanged, the new
block when one is added, the whole table when it changed otherwise (a preemption, a swap, a
sliding-window release). The worker's cache applies them in plan order. Handles of finished
sequences are dropped on both sides (`release`), the drop riding the next plan.

`parallel.sequence_cache: false` sends whole tables (the ablation).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Hashable, Sequence


_NOTHING: list[int] = []     # the tail of an unchanged table (never changed: read only)


@dataclass
class TableDeltas:
    """A plan's block tables as changes. Group 0 is the plan's block_tables, groups 1.. its
    group_tables (KV layer groups)."""

    handles: list[int]              # per item: its sequence's handle
    keeps: list[list[int]]          # [group][item]: entries of the cached table that stay
    tails: list[list[list[int]]]    # [group][item]: the entries after them
    dropped: list[int]              # handles to forget before reading the items


class TableEncoder:
    """The controller's side: what each rank of one executor holds."""

    def __init__(self):
        self._handles: dict[Hashable, int] = {}
        self._free: list[int] = []
        self._sent: list[dict[int, list[int]]] = []   # [group] handle -> the table last sent
        self._dropped: list[int] = []

    def _handle(self, seq_id: Hashable) -> int:
        handle = self._handles.get(seq_id)
        if handle is None:
            handle = self._free.pop() if self._free else len(self._handles) + len(self._free)
            self._handles[seq_id] = handle
        return handle

    def release(self, seq_id: Hashable) -> None:
        handle = self._handles.pop(seq_id, None)
        if handle is not None:
            for sent in self._sent:
                sent.pop(handle, None)
            self._dropped.append(handle)
            self._free.append(handle)

    def encode(self, plan, seq_ids: Sequence[Hashable]):
        """A copy of `plan` (a StepPlan) whose tables travel as TableDeltas; seq_ids: its items'
        sequences, in item order. The plan itself is left as it is."""
        handles = [self._handle(seq_id) for seq_id in seq_ids]
        groups = [plan.block_tables, *plan.group_tables]
        while len(self._sent) < len(groups):
            self._sent.append({})
        keeps, tails = [], []
        for sent, tables in zip(self._sent, groups):
            group_keeps, group_tails = [], []
            for handle, table in zip(handles, tables):
                old = sent.get(handle)
                if old is not None:
                    kept = len(old)
                    if len(table) == kept and table == old:      # most decode steps
                        group_keeps.append(kept)
                        group_tails.append(_NOTHING)             # one pickled object, shared
                        continue
                    if len(table) > kept and table[:kept] == old:
                        tail = table[kept:]
                        old.extend(tail)         # our own copy (the block manager's table
                        group_keeps.append(kept)  # grows in place, so it is never stored)
                        group_tails.append(tail)
                        continue
                sent[handle] = list(table)       # new, or changed otherwise: whole
                group_keeps.append(0)
                group_tails.append(list(table))  # not the stored copy: a held plan keeps it
            keeps.append(group_keeps)
            tails.append(group_tails)
        deltas = TableDeltas(handles, keeps, tails, self._dropped)
        self._dropped = []
        return dataclasses.replace(plan, block_tables=[], group_tables=[], table_deltas=deltas)


class TableCache:
    """A worker's side: the tables of its replica's running sequences, by handle."""

    def __init__(self):
        self._tables: list[dict[int, list[int]]] = []   # [group] handle -> table

    def apply(self, plan):
        """`plan` with its block_tables (and group_tables) filled from its TableDeltas; a plan
        sent with whole tables (or none) as it is. A table handed out is never changed in place:
        plans still waiting for their forward keep theirs."""
        deltas = plan.table_deltas
        if deltas is None:
            return plan
        for handle in deltas.dropped:
            for tables in self._tables:
                tables.pop(handle, None)
        while len(self._tables) < len(deltas.keeps):
            self._tables.append({})
        groups = []
        for cache, keeps, tails in zip(self._tables, deltas.keeps, deltas.tails):
            rows = []
            for handle, kept, tail in zip(deltas.handles, keeps, tails):
                old = cache.get(handle)
                if kept and (old is None or len(old) != kept):     # the encoder keeps all or none
                    raise RuntimeError(f"plan {plan.mb_id}: a table delta keeps {kept} entries "
                                       f"of a cached table of {len(old or [])}: the "
                                       "controller's and this worker's caches disagree")
                if old is not None and kept == len(old) and not tail:
                    table = old                  # unchanged: most decode steps
                else:
                    table = old + tail if kept else tail
                cache[handle] = table
                rows.append(table)
            groups.append(rows)
        plan.block_tables, plan.group_tables = groups[0], groups[1:]
        plan.table_deltas = None
        return plan
