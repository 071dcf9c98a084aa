"""SiPipe's sampler pool: which sampler processes sample a micro-batch, and which of them samples
each of its rows (controller side, pure Python; the last stage reads the same layout).

The paper hands every micro-batch's logits to a pool of CPU samplers: BIC-L broadcasts them to
all, each samples its share and fills its subslot of the result (BIC-O), and the micro-batch is
done when every subslot is (§4, §6). The column-wise state is kept in p replicas, one per
micro-batch residue n mod p (§5.1: micro-batches n and n + p carry the same sequences). So with
`split_columns` (the paper's pool):

- `samplers` processes, each holding p state replicas of ceil(max_num_seqs / samplers) columns;
  micro-batch n is sampled by every process, each from its replica n mod p;
- a sequence keeps its sampler while it stays in its micro-batch; a new one goes to the sampler
  with the fewest columns, and when two shares differ by more than one column the largest hands
  its last column to the smallest (rebuilt there from the prompt and output, as any join), so
  the pool's slowest member has ceil(B / samplers) columns.

Without the split: p processes of one replica each, micro-batch n wholly on sampler n mod p.
Either way micro-batch n's logits go to logits slot n mod p, transposed ([V, B]), the shares'
columns side by side in pool order, and each sampler reads its own columns there in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .columns import ColumnAssigner, ColumnJoin, ColumnUpdate


@dataclass(frozen=True)
class PoolLayout:
    samplers: int       # sampler processes per engine replica
    replicas: int       # column-state replicas in each sampler
    depth: int          # p: micro-batches in flight, and logits slots
    capacity: int       # columns of each state replica
    split: bool

    @classmethod
    def of(cls, depth: int, max_num_seqs: int, split: bool, samplers: int) -> "PoolLayout":
        if not split:
            return cls(samplers=depth, replicas=1, depth=depth, capacity=max_num_seqs, split=False)
        return cls(samplers=samplers, replicas=depth, depth=depth,
                   capacity=-(-max_num_seqs // samplers), split=True)

    @property
    def num_targets(self) -> int:
        """State replicas of the whole pool (one `consumed` entry each)."""
        return self.samplers * self.replicas

    @property
    def slot_columns(self) -> int:
        """The most sampled rows one micro-batch can have: the columns of a logits slot."""
        return (self.samplers if self.split else 1) * self.capacity

    def target(self, sampler: int, replica: int) -> int:
        return sampler * self.replicas + replica

    def shares_of(self, mb_id: int) -> list[tuple[int, int]]:
        """(sampler, replica) of each share of micro-batch mb_id, in column order."""
        residue = mb_id % self.depth
        if self.split:
            return [(sampler, residue) for sampler in range(self.samplers)]
        return [(residue, 0)]


@dataclass
class SamplerStep:
    """What a sampler gets from the controller for its share of a micro-batch (BIC-I)."""

    mb_id: int
    replica: int            # which of the sampler's state replicas
    update: ColumnUpdate    # moves and joins before sampling; update.width: the share's columns
    offset: int             # the share's first column in the micro-batch's logits slot
    row_length: int         # the micro-batch's sampled rows: the slot's [V, row_length] view


class ShareAssigner:
    """One residue's sampled rows across its shares (a ColumnAssigner each)."""

    def __init__(self, shares: int, capacity: int):
        self.assigners = [ColumnAssigner(capacity) for _ in range(shares)]
        self.home: dict[str, int] = {}       # request id -> share
        self.handed_over = 0                 # columns moved between shares to rebalance

    def assign(self, request_ids: list[str], output_lens: list[int],
               join_of: Callable[[str, int], ColumnJoin]) -> tuple[list[int], list[ColumnUpdate]]:
        """-> each row's column in the slot (plan order; share k's columns follow share k - 1's)
        and each share's update."""
        shares, capacity = len(self.assigners), self.assigners[0].capacity
        if len(request_ids) > shares * capacity:
            raise ValueError(f"{len(request_ids)} sampled rows in one micro-batch exceed the "
                             f"sampler pool's {shares} x {capacity} columns")
        present = set(request_ids)
        for rid in [r for r in self.home if r not in present]:
            del self.home[rid]
        members: list[list[str]] = [[] for _ in range(shares)]
        for rid in request_ids:
            if rid in self.home:
                members[self.home[rid]].append(rid)
        for rid in request_ids:
            if rid not in self.home:
                share = min(range(shares), key=lambda k: len(members[k]))
                self.home[rid] = share
                members[share].append(rid)
        self._rebalance(members)
        rows: list[list[int]] = [[] for _ in range(shares)]
        for row, rid in enumerate(request_ids):
            rows[self.home[rid]].append(row)
        columns = [0] * len(request_ids)
        updates, offset = [], 0
        for assigner, share_rows in zip(self.assigners, rows):
            cols, update = assigner.assign([request_ids[r] for r in share_rows],
                                           [output_lens[r] for r in share_rows], join_of)
            for row, col in zip(share_rows, cols):
                columns[row] = offset + col
            updates.append(update)
            offset += update.width
        return columns, updates

    def _rebalance(self, members: list[list[str]]) -> None:
        """While two shares differ by more than one column, the largest gives the sequence in its
        highest column (no move inside it) to the smallest."""
        while True:
            big = max(range(len(members)), key=lambda k: len(members[k]))
            small = min(range(len(members)), key=lambda k: len(members[k]))
            if len(members[big]) - len(members[small]) <= 1:
                return
            column = self.assigners[big].column
            rid = max(members[big], key=lambda r: column.get(r, -1))
            members[big].remove(rid)
            members[small].append(rid)
            self.home[rid] = small
            self.handed_over += 1
