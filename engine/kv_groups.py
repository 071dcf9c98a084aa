"""KV layer groups: a hybrid-window model's layers split into groups with one block table each.

Gemma 2 / 3 (and GPT-OSS) alternate sliding-window layers with global ones. A block that holds
every layer's K/V can never be released (the global layers read the whole context), so such a
model holds its whole context even in the windowed layers. As vLLM's hybrid KV allocator does,
the layers are split into groups of one kind (window), each sequence has one block table per
group, and the windowed groups release their blocks behind the window while the global groups
keep theirs (group_blocks.GroupedBlockManager).

The pool is shared, not split (vLLM's "uniform page size"): every group has the same number of
layers, `page_layers` (the smallest kind's layer count; a kind whose count is not a multiple of it
gets a last group with fewer layers, whose blocks leave the missing slots unused). A block is one
page: the K/V of `page_layers` layers for block_size positions, and the cache is `page_layers`
K/V tensor pairs ("slots"), layer j of every group reading and writing slot j. A block id belongs
to one group's table at a time, so layers that share a slot never share a block. Any free block
serves any group: there is no split to tune, and a job of short sequences (which release
nothing) and one of long ones (whose windowed groups hold a few blocks each) both use the whole
pool. A sequence holds, per global group, a block per block_size tokens of its context, and per
windowed group at most ceil((window + n - 1) / block_size) + 1 while a step computes n of its
tokens.

Gemma 2 (windowed and global alternating) has two groups of num_layers / 2 layers; Gemma 3 1B
(22 windowed layers of 512 keys, 4 global) seven groups of 4 layers (the last windowed one of
2): past its windows a sequence's context costs one page (4 layers) a block, where one table over
every layer costs 26 layers a block.

Only the baseline strategy's schedulers (one process, or the pipeline / tensor-parallel
runtime) run with groups. Other strategies keep every block of a hybrid model, as before: their
own KV arithmetic (token forecasts, tier copies, their own workers' tables) counts one table per
sequence (`groups_for` logs why).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVGroupLayout:
    """Which group and which slot of a block each layer's K/V lives in."""

    windows: tuple[int, ...]       # per group: its layers' sliding window (0: global); 0 first
    layer_group: tuple[int, ...]   # per layer: its group
    layer_slot: tuple[int, ...]    # per layer: its K/V tensor pair (slot) within a page
    page_layers: int               # layers a block holds (the K/V tensor pairs of the cache)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def slots_of(self, layer_start: int, layer_end: int) -> list[int]:
        """The slots the layers [layer_start, layer_end) use (a pipeline stage allocates these)."""
        return sorted({self.layer_slot[layer] for layer in range(layer_start, layer_end)})

    def layer_caches(self, pairs: Sequence, layer_start: int, layer_end: int) -> list:
        """Each layer's (key, value) pair among `pairs`, the tensors of slots_of(start, end)."""
        index = {slot: i for i, slot in enumerate(self.slots_of(layer_start, layer_end))}
        return [pairs[index[self.layer_slot[layer]]] for layer in range(layer_start, layer_end)]

    def blocks_per_sequence(self, tokens: int, block_size: int) -> int:
        return blocks_per_sequence(self.windows, tokens, block_size)

    def describe(self) -> dict:
        """report.json's engine.kv_groups."""
        layers = [[layer for layer, g in enumerate(self.layer_group) if g == group]
                  for group in range(self.num_groups)]
        return {"windows": list(self.windows), "layers": layers, "page_layers": self.page_layers}


def blocks_per_sequence(windows: Sequence[int], tokens: int, block_size: int) -> int:
    """The most blocks one decoding sequence of `tokens` tokens holds over groups of these
    windows (a global group a block per block_size tokens, a windowed one its window's and one
    more)."""
    whole = -(-tokens // block_size)
    return sum(whole if not window else min(whole, -(-window // block_size) + 1)
               for window in windows)


def group_layout(layer_windows: Sequence[int]) -> Optional[KVGroupLayout]:
    """The groups of a model whose layers mix windowed and global attention; None for any
    other model (no window, or a window on every layer: one table as before). Layers of a kind
    go to its groups in layer order, so a page's slots hold neighbouring layers (a pipeline
    stage's slice of the layers uses few slots)."""
    kinds: dict[int, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(int(window), []).append(layer)
    if 0 not in kinds or len(kinds) < 2:
        return None
    page = min(len(layers) for layers in kinds.values())
    windows: list[int] = []
    layer_group = [0] * len(layer_windows)
    layer_slot = [0] * len(layer_windows)
    for window in sorted(kinds):               # 0 first: the global layers anchor the tables
        layers = kinds[window]
        for start in range(0, len(layers), page):
            for slot, layer in enumerate(layers[start:start + page]):
                layer_group[layer], layer_slot[layer] = len(windows), slot
            windows.append(window)
    return KVGroupLayout(tuple(windows), tuple(layer_group), tuple(layer_slot), page)


def groups_for(config, arch) -> Optional[KVGroupLayout]:
    """The layout the engine runs `arch` with under `config`: None keeps one table per sequence
    (no hybrid windows; memory.free_outside_window false, the ablation; a strategy other than
    the baseline, logged)."""
    layout = group_layout(arch.layer_windows)
    if layout is None or not config.cache.free_outside_window:
        return None
    strategy = config.strategy
    if strategy is not None and strategy.name != "baseline":
        log.info("KV cache: strategy %s keeps every block of this model's windowed layers (its "
                 "scheduling counts one block table per sequence; per-layer-group tables run "
                 "with the baseline strategy)", strategy.name)
        return None
    return layout


def check_group_capacity(layout: Optional[KVGroupLayout], num_blocks: int, block_size: int,
                         max_model_len: int) -> None:
    """A ConfigError where one max_model_len-token request does not fit the pool's blocks."""
    if layout is None:
        return
    need = layout.blocks_per_sequence(max_model_len, block_size)
    if need > num_blocks:
        from .errors import ConfigError

        raise ConfigError(f"the KV cache holds {num_blocks} blocks of {block_size} (pages of "
                          f"{layout.page_layers} layers); a {max_model_len}-token request "
                          f"holds {need} over its {layout.num_groups} layer groups: raise "
                          "cache.kv_cache_memory or lower model.max_model_len")


def log_kv_groups(layout: Optional[KVGroupLayout], num_blocks: int, block_size: int,
                  max_model_len: int) -> None:
    """The start-up log's lines for a cache with layer groups."""
    if layout is None:
        return
    windowed = sorted({w for w in layout.windows if w})
    per_request = layout.blocks_per_sequence(max_model_len, block_size)
    log.info("KV cache: %d layer groups of %d layers (windows %s): the windowed groups release "
             "a sequence's blocks behind their window, the global ones keep its context; a "
             "%d-token request holds up to %d blocks", layout.num_groups, layout.page_layers,
             "/".join(map(str, windowed)), max_model_len, per_request)
