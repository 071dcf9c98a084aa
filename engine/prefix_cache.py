"""Automatic prefix caching's index: which KV blocks hold which token contents.

A full block is known by a chained key, the hash of its tokens and of its parent block's key, so
equal prefixes give equal keys. A lookup never trusts a hash: each cached block keeps its own
tokens and the identity (block, generation) of its parent, and a match must equal both, walking
from a sequence's first block, so a hash collision can only miss, never hand out another
prefix's KV. Blocks that no sequence holds stay cached (evictable, least recently used first)
until the block manager needs the room; a block evicted and reused gets a new generation, so the
cached blocks that followed it can no longer match (they are evicted in their turn).

Layer groups (engine/kv_groups.py: a hybrid-window model's windowed and global layers, each with
its own block table): the chain is the first (global) group's blocks, the anchors; each anchor
keeps its row, the other groups' blocks for the same positions (companions), attached when the
row is indexed. A companion nobody holds is parked and evicted like an anchor; evicting it
empties its slot of the row, and evicting an anchor drops its row (its parked companions go back
to the pool: `orphans`). The block manager matches a prefix only as far as the rows its windows
still need are whole (kv_groups.GroupedBlockManager.match_prefix).

A chain may start from a root (`Request.prefix_root`: a LoRA adapter) instead of nothing: the
root stands for the first block's parent and parent key, so two adapters' equal prompts never
share a block (vLLM puts the LoRA id in the block hash's extra keys).

Pure Python over block ids, used by the block manager (engine/kv_cache.py).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

# (block, generation) of the previous block; the chain's root for the first (None: no root)
Parent = Optional[tuple]


@dataclass(frozen=True)
class _Entry:
    key: int
    tokens: tuple[int, ...]
    parent: Parent
    generation: int


class PrefixIndex:
    def __init__(self, hash_fn: Callable[[object], int] = hash):
        """hash_fn: of (parent key, tokens); tests pass a colliding one."""
        self._hash = hash_fn
        self._entries: dict[int, _Entry] = {}          # cached block -> what it holds
        self._by_key: dict[int, list[int]] = {}        # chained key -> cached blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()   # held by nobody, LRU first
        self._generation = 0
        # layer groups only: anchor -> its companions per other group; companion -> its anchor
        self._rows: dict[int, list[Optional[int]]] = {}
        self._anchor_of: dict[int, int] = {}
        self.orphans: list[int] = []     # parked companions whose anchor was evicted (now free)

    # --- queries --------------------------------------------------------------------------------
    def is_cached(self, block: int) -> bool:
        return block in self._entries or block in self._anchor_of

    def companion(self, anchor: int, group: int) -> Optional[int]:
        """The block of companion group `group` (0: the first group after the anchors') in
        cached `anchor`'s row; None where it was never attached or was evicted."""
        row = self._rows.get(anchor)
        return row[group] if row is not None and group < len(row) else None

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def key_of(self, block: int) -> int:
        return self._entries[block].key

    def chain_keys(self, token_ids: Sequence[int], block_size: int, first: int, count: int,
                   parent_key: Optional[int]) -> list[int]:
        """The chained keys of full blocks first .. first + count - 1 of token_ids, after a block
        whose key is parent_key (None: from the start). Keys only, nothing verified: for
        decisions a collision can only make slower, never wrong."""
        keys = []
        for i in range(first, first + count):
            parent_key = self._hash((parent_key,
                                     tuple(token_ids[i * block_size:(i + 1) * block_size])))
            keys.append(parent_key)
        return keys

    def match(self, token_ids: Sequence[int], block_size: int, max_blocks: int,
              root: Optional[tuple] = None) -> list[int]:
        """The cached blocks that hold token_ids' first full blocks, in order (at most
        max_blocks), stopping at the first block not cached. root: the chain's (a LoRA
        adapter's; None: none)."""
        blocks: list[int] = []
        parent: Parent = root
        parent_key: Optional[object] = root
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
            if len(tokens) < block_size:
                break
            key = self._hash((parent_key, tokens))
            found = self._find(key, tokens, parent)
            if found is None:
                break
            blocks.append(found)
            parent, parent_key = (found, self._entries[found].generation), key
        return blocks

    # --- changes --------------------------------------------------------------------------------
    def register(self, block: int, parent_block: Optional[int],
                 tokens: tuple[int, ...], root: Optional[tuple] = None) -> Optional[int]:
        """`block` now holds `tokens`, following cached `parent_block` (None: a sequence's
        first block, after `root`). -> the cached block that stands for this content from now
        on: `block`, or an equal block cached before it (`block` then stays private); None when
        the parent is no longer cached (nothing after it can be)."""
        if block in self._entries:
            return block
        if parent_block is None:
            parent, parent_key = root, root
        else:
            entry = self._entries.get(parent_block)
            if entry is None:
                return None
            parent, parent_key = (parent_block, entry.generation), entry.key
        key = self._hash((parent_key, tokens))
        equal = self._find(key, tokens, parent)
        if equal is not None:
            return equal
        self._generation += 1
        self._entries[block] = _Entry(key, tokens, parent, self._generation)
        self._by_key.setdefault(key, []).append(block)
        return block

    def attach(self, anchor: int, group: int, block: int, num_groups: int) -> None:
        """`block` holds the KV of cached `anchor`'s positions for companion group `group` (of
        `num_groups`). Kept only where that slot of the row is empty and `block` is cached
        nowhere else (an equal row cached first keeps its own)."""
        if anchor not in self._entries or block in self._entries or block in self._anchor_of:
            return
        row = self._rows.setdefault(anchor, [None] * num_groups)
        if row[group] is None:
            row[group] = block
            self._anchor_of[block] = anchor

    def take_orphans(self) -> list[int]:
        orphans, self.orphans = self.orphans, []
        return orphans

    def park(self, block: int) -> None:
        """A cached block no sequence holds any more: evictable, most recently used."""
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """A parked block a sequence takes again."""
        del self._evictable[block]

    def evict(self) -> int:
        """Drops the least recently used evictable block from the cache; -> the block."""
        block, _ = self._evictable.popitem(last=False)
        anchor = self._anchor_of.pop(block, None)
        if anchor is not None:             # a companion: its slot of the row is empty now
            row = self._rows[anchor]
            row[row.index(block)] = None
            return block
        for companion in self._rows.pop(block, ()):
            if companion is not None:
                del self._anchor_of[companion]
                if companion in self._evictable:       # parked: nothing holds it now
                    del self._evictable[companion]
                    self.orphans.append(companion)
        entry = self._entries.pop(block)
        bucket = self._by_key[entry.key]
        bucket.remove(block)
        if not bucket:
            del self._by_key[entry.key]
        return block

    def _find(self, key: int, tokens: tuple[int, ...], parent: Parent) -> Optional[int]:
        for block in self._by_key.get(key, ()):
            entry = self._entries[block]
            if entry.tokens == tokens and entry.parent == parent:
                return block
        return None
