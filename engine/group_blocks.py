"""The block manager of a model with KV layer groups (kv_groups.py): one table per group.

Every sequence has one block table per group, all of the same length (a slot per block_size
positions), over one shared pool of blocks. The first group is global (window 0) and is the
"anchor": `block_table` returns its table, the prefix cache chains its blocks, and it is never
released. The windowed groups release their leading blocks behind the window after each step,
as the one-table manager does when every layer has a window (placeholders keep positions on
their slots). What the scheduler asks (`blocks_needed`, `can_grow`, `num_free_blocks`, `usage`)
counts blocks of every group, so admission, preemption and kv_usage see what is really held.

Prefix caching: an anchor block is indexed with its row, the windowed groups' blocks of the same
positions (prefix_cache.PrefixIndex companions); a row whose companion was evicted gets the
block of the next sequence that computes those positions again. A match of k blocks is kept only
as far as every windowed group still has the blocks its window needs at the first position to
compute (`_whole_prefix`): a row whose companion was evicted can still serve a longer match's
early positions, where the windowed groups take placeholders, but never a position inside a window.
A
companion released behind a sequence's window stays valid while parked, as any cached block.
"""
from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence

from .kv_cache import _CHAIN_BROKEN, PLACEHOLDER_BLOCK, BlockManager


class GroupedBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int],
                 watermark: float = 0.01, prefix_caching: bool = False,
                 hash_fn: Callable[[object], int] = hash):
        """windows: each group's sliding window; the first 0 (a global group), some not."""
        windows = tuple(windows)
        if len(windows) < 2 or windows[0] != 0 or not any(windows):
            raise ValueError(f"layer groups need a global first group and a windowed one, "
                             f"got windows {windows}")
        super().__init__(num_blocks, block_size, watermark, prefix_caching, hash_fn,
                         window=max(windows))
        self.windows = windows
        # seq -> the tables of groups 1.. (group 0's is BlockManager's), and their released slots
        self._group_tables: dict[Hashable, list[list[int]]] = {}
        self._group_released: dict[Hashable, list[int]] = {}
        self.peak_group_blocks = [0] * len(windows)   # the most one sequence held, per group

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def table_windows(self) -> tuple[int, ...]:
        return self.windows

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds for sequences that release nothing (every group a block per
        block_size tokens): windowed groups' releases make room for more."""
        return self.num_blocks // self.num_groups * self.block_size

    def max_concurrency(self, max_model_len: int) -> float:
        """Decoding max_model_len-token requests the pool holds at once."""
        from .kv_groups import blocks_per_sequence

        return self.num_blocks / blocks_per_sequence(self.windows, max_model_len, self.block_size)

    # --- queries -------------------------------------------------------------------------------
    def group_tables(self, seq_id: Hashable) -> list[list[int]]:
        """The tables of groups 1.. (group 0's is block_table); released slots hold the
        placeholder."""
        return self._group_tables.get(seq_id, [[] for _ in self.windows[1:]])

    def held_per_group(self, seq_id: Hashable) -> list[int]:
        anchor = len(self._tables.get(seq_id, ()))
        released = self._group_released.get(seq_id, [0] * (self.num_groups - 1))
        return [anchor] + [len(t) - r for t, r in zip(self.group_tables(seq_id), released)]

    def num_held_blocks(self, seq_id: Hashable) -> int:
        return sum(self.held_per_group(seq_id))

    def released_slots(self, seq_id: Hashable) -> tuple[int, ...]:
        return (0, *self._group_released.get(seq_id, [0] * (self.num_groups - 1)))

    def blocks_needed(self, seq_id: Hashable, total_tokens: int) -> int:
        """Blocks to add, over all groups (each adds the same number of slots)."""
        return self.num_groups * super().blocks_needed(seq_id, total_tokens)

    # --- changes -------------------------------------------------------------------------------
    def grow(self, seq_id: Hashable, total_tokens: int) -> list[int]:
        slots = super().blocks_needed(seq_id, total_tokens)
        if slots * self.num_groups > self.num_free_blocks:
            raise MemoryError(f"need {slots * self.num_groups} KV blocks, "
                              f"{self.num_free_blocks} free")
        tables = [self._tables.setdefault(seq_id, [])] + self._others(seq_id)
        new = []
        for table in tables:
            blocks = [self._take() for _ in range(slots)]
            for block in blocks:
                self._ref[block] = 1
            table.extend(blocks)
            new.extend(blocks)
        held = self.held_per_group(seq_id)
        self.peak_group_blocks = [max(p, h) for p, h in zip(self.peak_group_blocks, held)]
        self.peak_seq_blocks = max(self.peak_seq_blocks, sum(held))
        return new

    def adopt(self, seq_id: Hashable, slots: int, released: Sequence[int]) -> list[list[int]]:
        """Tables of `slots` slots for every group, the first released[g] of group g released
        (the anchor releases none): a sequence copied in from a KV tier holds only the blocks
        its windows still need."""
        released = list(released)
        if len(released) != self.num_groups or released[0]:
            raise ValueError(f"{self.num_groups} tables, the first (global) with no released "
                             f"slot, expected; got released {released}")
        if self._tables.get(seq_id):
            raise ValueError(f"{seq_id!r} already has blocks")
        need = self.blocks_for_shape(slots, released)
        if need > self.num_free_blocks:
            raise MemoryError(f"need {need} KV blocks, {self.num_free_blocks} free")
        tables = []
        for skip in released:
            blocks = [self._take() for _ in range(slots - skip)]
            for block in blocks:
                self._ref[block] = 1
            tables.append([PLACEHOLDER_BLOCK] * skip + blocks)
        self._tables[seq_id] = tables[0]
        self._group_tables[seq_id] = tables[1:]
        self._group_released[seq_id] = released[1:]
        held = self.held_per_group(seq_id)
        self.peak_group_blocks = [max(p, h) for p, h in zip(self.peak_group_blocks, held)]
        self.peak_seq_blocks = max(self.peak_seq_blocks, need)
        return self.tables(seq_id)

    def reserve_block(self, owner: Hashable) -> Optional[int]:
        """One block, not one per group (`grow` would take num_groups): the padding rows of a
        CUDA graph write every group's K/V into the same block, garbage no query reads, so one
        page serves them all. It is the anchor table's one slot; the other groups' slot is
        released (the placeholder), which keeps the tables' lengths and check_invariants."""
        if self._tables.get(owner):
            raise ValueError(f"{owner!r} already has blocks")
        if self.num_free_blocks < 1:
            return None
        block = self._take()
        self._ref[block] = 1
        self._tables[owner] = [block]
        self._group_tables[owner] = [[PLACEHOLDER_BLOCK] for _ in self.windows[1:]]
        self._group_released[owner] = [1] * (self.num_groups - 1)
        return block

    def share(self, seq_id: Hashable, blocks: list[int]) -> None:
        raise NotImplementedError("with layer groups a sequence shares every group's table: "
                                  "share_tables")

    def share_tables(self, seq_id: Hashable, donor: Hashable) -> None:
        if self._tables.get(seq_id):
            raise ValueError(f"{seq_id!r} already has blocks")
        donor_tables = [self.block_table(donor)] + self.group_tables(donor)
        released = list(self._group_released.get(donor, [0] * (self.num_groups - 1)))
        for group, table in enumerate(donor_tables):
            skip = released[group - 1] if group else 0
            for block in table[skip:]:
                self._ref[block] += 1
        self._tables[seq_id] = list(donor_tables[0])
        self._group_tables[seq_id] = [list(t) for t in donor_tables[1:]]
        self._group_released[seq_id] = released

    def free(self, seq_id: Hashable) -> None:
        """Tail first, a row at a time: each slot's global block, then the windowed groups'
        blocks of the same positions. Parked blocks are evicted least recently parked first, so
        a row goes whole (its anchor first, which sends its parked companions back to the pool:
        prefix_cache.PrefixIndex.orphans), never its in-window companions before the anchors
        they make matchable."""
        self._indexed.pop(seq_id, None)
        self._done_computing(seq_id, None)
        table = self._tables.pop(seq_id, [])
        others = self._group_tables.pop(seq_id, [])
        released = self._group_released.pop(seq_id, [])
        for i in reversed(range(len(table))):
            self._drop(table[i])
            for other, skip in zip(others, released):
                if i >= skip:
                    self._drop(other[i])

    def release_outside_window(self, seq_id: Hashable, first_query: int) -> int:
        """Each windowed group releases `seq_id`'s leading blocks no query at `first_query` or
        later can see; -> how many, over the groups. The anchor (global) group keeps all, so
        the prefix chain is never broken by a release."""
        tables = self._group_tables.get(seq_id)
        if not tables:
            return 0
        released = self._group_released[seq_id]
        freed = 0
        for group, (window, table) in enumerate(zip(self.windows[1:], tables)):
            if not window:
                continue
            upto = min(self._first_kept(first_query, window), len(table))
            for i in range(released[group], upto):
                self._drop(table[i])
                table[i] = PLACEHOLDER_BLOCK
                freed += 1
            released[group] = max(released[group], upto)
        self.window_freed_blocks += freed
        return freed

    def _first_kept(self, first_query: int, window: int) -> int:
        """The first slot a query at `first_query` or later can see through `window`."""
        return max(0, (first_query - window + 1) // self.block_size)

    def _others(self, seq_id: Hashable) -> list[list[int]]:
        if seq_id not in self._group_tables:
            self._group_tables[seq_id] = [[] for _ in self.windows[1:]]
            self._group_released[seq_id] = [0] * (self.num_groups - 1)
        return self._group_tables[seq_id]

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        block = self.prefix.evict()
        self._free.extend(self.prefix.take_orphans())   # an evicted anchor's parked row
        return block

    # --- prefix caching ---------------------------------------------------------------------------
    def match_prefix(self, seq_id: Hashable, token_ids: Sequence[int],
                     root: Optional[tuple] = None) -> int:
        if self.prefix is None:
            return 0
        if self._tables.get(seq_id):
            raise ValueError(f"{seq_id!r} already has blocks")
        max_blocks = max(len(token_ids) - 1, 0) // self.block_size
        anchors = self.prefix.match(token_ids, self.block_size, max_blocks, root)
        count = self._whole_prefix(anchors)
        self._indexed[seq_id] = (count, anchors[count - 1] if count else None)
        if not count:
            return 0
        taken = list(anchors[:count])
        self._tables[seq_id] = list(taken)
        others, released = self._others(seq_id), self._group_released[seq_id]
        for group, window in enumerate(self.windows[1:]):
            first = min(self._first_kept(count * self.block_size, window), count) if window else 0
            blocks = [self.prefix.companion(a, group) for a in anchors[first:count]]
            others[group][:] = [PLACEHOLDER_BLOCK] * first + blocks
            released[group] = first
            taken.extend(blocks)
        for block in taken:
            if self._ref[block] == 0:
                self.prefix.unpark(block)
            self._ref[block] += 1
        return count * self.block_size

    def _whole_prefix(self, anchors: list[int]) -> int:
        """The longest prefix of matched `anchors` whose rows hold every companion the windowed
        groups need at its first uncomputed position (global companion groups: every row)."""
        for count in range(len(anchors), 0, -1):
            first_query = count * self.block_size
            if all(self.prefix.companion(anchors[i], group) is not None
                   for group, window in enumerate(self.windows[1:])
                   for i in range(min(self._first_kept(first_query, window), count)
                                  if window else 0, count)):
                return count
        return 0

    def cache_computed(self, seq_id: Hashable, token_ids: Sequence[int],
                       num_computed: int, root: Optional[tuple] = None) -> None:
        """Indexes the anchors of `seq_id`'s computed full blocks, each with its row (the slots
        a windowed group already released stay out of it)."""
        if not self.has_uncached_blocks(seq_id, num_computed):
            return
        table, others = self._tables[seq_id], self._others(seq_id)
        released = self._group_released[seq_id]
        full = min(num_computed // self.block_size, len(table))
        done, parent = self._indexed.get(seq_id, (0, None))
        for i in range(done, full):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            cached = self.prefix.register(table[i], parent, tokens, root)
            if cached is None:
                self._indexed[seq_id] = (_CHAIN_BROKEN, None)
                return
            # the row of an anchor cached before (`cached` is not table[i]) may have lost a
            # companion to eviction: this sequence's block of the same positions fills the slot
            # (attach fills empty slots only; a block not attached stays private, freed as such)
            for group, other in enumerate(others):
                if i >= released[group]:
                    self.prefix.attach(cached, group, other[i], self.num_groups - 1)
            parent = cached
        self._indexed[seq_id] = (full, parent)

    def check_invariants(self) -> None:
        """BlockManager's, over every group's table; all of a sequence's tables as long."""
        held: dict[int, int] = {}
        for seq_id, table in self._tables.items():
            for block in table:
                held[block] = held.get(block, 0) + 1
            others = self._group_tables.get(seq_id, [])
            for other, released in zip(others, self._group_released.get(seq_id, [])):
                assert len(other) == len(table), f"{seq_id!r}: tables of different lengths"
                assert all(b == PLACEHOLDER_BLOCK for b in other[:released]), \
                    f"{seq_id!r}: a released slot holds a block"
                for block in other[released:]:
                    held[block] = held.get(block, 0) + 1
        assert set(self._group_tables) == set(self._tables), "a sequence lacks a group's table"
        self._check_pool(held)
