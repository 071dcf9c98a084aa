"""Which column of a sampler replica's buffers each sequence owns (controller side, pure Python).

SiPipe keeps p column-wise replicas of the sampling state for PP degree p: micro-batch n goes to
replica n mod p, and micro-batches n and n + p are (nearly) the same sequences, so a sequence
keeps its column from one visit to the next and only its new token touches the buffers (§5.1).
This object decides the columns and tells the replica what moved:

- columns stay dense, [0, width): a sequence that left the micro-batch frees its column and the
  last column moves into the hole (one O(V) copy per leaver, never a re-layout of the batch);
- a sequence new to the replica (or whose history the replica does not have: it sampled
  elsewhere, or the controller trimmed its output) `joins`: the replica rebuilds its column from
  the prompt and the output so far.
The last stage writes each sampled row's logits into its column, so the sampler reads them in
buffer order with no gather.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass
class ColumnJoin:
    column: int
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: object            # SamplingParams
    seed: int
    bad_words_token_ids: Optional[list[list[int]]] = None   # the request's, as the engine's


@dataclass
class ColumnUpdate:
    """What the replica does before sampling a micro-batch: moves (in order), then joins."""

    width: int
    moves: list[tuple[int, int]] = field(default_factory=list)   # (source, destination)
    joins: list[ColumnJoin] = field(default_factory=list)


class ColumnAssigner:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.owner: list[str] = []             # column -> request id
        self.column: dict[str, int] = {}       # request id -> column
        self.expected: dict[str, int] = {}     # request id -> output length the replica holds

    @property
    def width(self) -> int:
        return len(self.owner)

    def assign(self, request_ids: list[str], output_lens: list[int],
               join_of: Callable[[str, int], ColumnJoin]) -> tuple[list[int], ColumnUpdate]:
        """-> the column of each sampled row (plan order), and the replica's update.

        `join_of(request_id, column)` builds a join from the controller's copy of the sequence."""
        if len(request_ids) > self.capacity:
            raise ValueError(f"{len(request_ids)} sampled rows in one micro-batch exceed the "
                             f"sampler's {self.capacity} columns")
        update = ColumnUpdate(width=0)
        present = set(request_ids)
        for rid in [r for r in self.owner if r not in present]:
            self._free(rid, update)
        columns = []
        for rid, n_out in zip(request_ids, output_lens):
            col = self.column.get(rid)
            if col is None:
                col = len(self.owner)
                self.owner.append(rid)
                self.column[rid] = col
                update.joins.append(join_of(rid, col))
            elif self.expected.get(rid) != n_out:
                update.joins.append(join_of(rid, col))
            self.expected[rid] = n_out + 1
            columns.append(col)
        update.width = len(self.owner)
        return columns, update

    def _free(self, rid: str, update: ColumnUpdate) -> None:
        col = self.column.pop(rid)
        self.expected.pop(rid, None)
        last = len(self.owner) - 1
        if col != last:
            moved = self.owner[last]
            self.owner[col] = moved
            self.column[moved] = col
            update.moves.append((last, col))
        self.owner.pop()
