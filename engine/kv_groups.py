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
tokens: a step grows every group by its n tokens before anything behind the window is released,
so the pool is sized for the largest step one sequence can take (`step_tokens`: a whole
max_model_len prompt under SB, a chunk under HB), not for a decoding sequence alone.

Gemma 2 (windowed and global alternating) has two groups of num_layers / 2 layers; Gemma 3 1B
(22 windowed layers of 512 keys, 4 global) seven groups of 4 layers (the last windowed one of
2): past its windows a sequence's context costs one page (4 layers) a block, where one table over
every layer costs 26 layers a block.

A strategy runs with groups where its schedulers count KV through this block manager (it says
so with `StrategyParams.kv_layer_groups`); one whose KV arithmetic counts a single table per
sequence keeps every block of a hybrid model (`groups_for` logs why). A CPU KV tier is a block
manager over the same groups (`BlockManager.adopt` gives a sequence moved into it the same
tables, released slots included). Which strategies do: docs/engine.md.
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

    def slot_range(self, layer_start: int, layer_end: int) -> Optional[tuple[int, int]]:
        """slots_of(start, end) as one range [first, end), or None where they leave a gap (a
        copy of a block's slots for these layers is then not one slice)."""
        slots = self.slots_of(layer_start, layer_end)
        if slots != list(range(slots[0], slots[-1] + 1)):
            return None
        return slots[0], slots[-1] + 1

    def layer_caches(self, pairs: Sequence, layer_start: int, layer_end: int) -> list:
        """Each layer's (key, value) pair among `pairs`, the tensors of slots_of(start, end)."""
        index = {slot: i for i, slot in enumerate(self.slots_of(layer_start, layer_end))}
        return [pairs[index[self.layer_slot[layer]]] for layer in range(layer_start, layer_end)]

    def blocks_per_sequence(self, tokens: int, block_size: int, step_tokens: int = 1) -> int:
        return blocks_per_sequence(self.windows, tokens, block_size, step_tokens)

    @property
    def store_slot(self) -> tuple[int, ...]:
        """Per layer: its place among its group's layers (in layer order), the slot it takes in
        a page of a store that holds each block's own group's layers only (a CPU KV tier
        shared by the stages): a block serves one group, so its page needs that group's
        layers, not every slot a stage stores."""
        seen = [0] * self.num_groups
        slots = []
        for group in self.layer_group:
            slots.append(seen[group])
            seen[group] += 1
        return tuple(slots)

    @property
    def group_sizes(self) -> tuple[int, ...]:
        """Per group: its layers."""
        return tuple(self.layer_group.count(group) for group in range(self.num_groups))

    @property
    def store_page_layers(self) -> int:
        """Layers of the largest group: a store page (at most page_layers; fewer where no group
        has a layer in every slot, as a by-stage layout whose groups each sit on one stage)."""
        return max(self.group_sizes)

    def copy_slots(self, layer_start: int, layer_end: int
                   ) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        """Per group: the slots its layers in [layer_start, layer_end) use, counted from the
        range's first slot (slot_range; the index into a stage's paged cache), and those
        layers' store slots. A copy of a block of group g between the paged cache and a store
        page moves these pairs only, so stages that share a page slot for different groups
        never write the same store slot."""
        first = self.slot_range(layer_start, layer_end)
        if first is None:
            raise ValueError(f"the slots of layers [{layer_start}, {layer_end}) are not one range")
        store = self.store_slot
        pairs: list[tuple[list[int], list[int]]] = [([], []) for _ in range(self.num_groups)]
        for layer in range(layer_start, layer_end):
            device, stored = pairs[self.layer_group[layer]]
            device.append(self.layer_slot[layer] - first[0])
            stored.append(store[layer])
        return tuple((tuple(device), tuple(stored)) for device, stored in pairs)

    def describe(self) -> dict:
        """report.json's engine.kv_groups."""
        layers = [[layer for layer, g in enumerate(self.layer_group) if g == group]
                  for group in range(self.num_groups)]
        return {"windows": list(self.windows), "layers": layers, "page_layers": self.page_layers}


def blocks_per_sequence(windows: Sequence[int], tokens: int, block_size: int,
                        step_tokens: int = 1) -> int:
    """The most blocks one sequence of up to `tokens` tokens holds over groups of these windows
    while a step computes up to `step_tokens` of its tokens (1: decoding): a global group a block
    per block_size tokens, a windowed one the blocks of the window before the step's first
    query and of the step's tokens, ceil((window + step_tokens - 1) / block_size) + 1, at most
    its whole context's."""
    whole = -(-tokens // block_size)
    return sum(whole if not window
               else min(whole, -(-(window + step_tokens - 1) // block_size) + 1)
               for window in windows)


def blocks_held(windows: Sequence[int], tokens: int, block_size: int) -> int:
    """Blocks a sequence of `tokens` computed tokens holds over tables of these windows once
    each windowed one released what its next query cannot see (BlockManager.
    release_outside_window at `tokens`): a global table a block per block_size tokens, a
    windowed one from the block of position tokens - window + 1 on."""
    whole = -(-tokens // block_size)
    return sum(whole - (min(max(0, (tokens - window + 1) // block_size), whole) if window else 0)
               for window in windows)


def step_tokens(config, max_model_len: int) -> tuple[int, str]:
    """The most tokens of one sequence a step of the scheduler computes, and the settings that
    set it: SB computes a whole prompt (up to max_model_len) in one step, HB a chunk of at most
    chunk_size (default max_num_batched_tokens) within the token budget. A strategy's own
    batching (its scheduler_config: whole prompts, or chunks within its prefill budget) is
    named by its recipe keys where it has the scheduler's, else by the strategy."""
    from .config import SchedulerConfig

    strategy = getattr(config, "strategy", None)
    own = strategy.scheduler_config() if strategy is not None else None
    if isinstance(own, SchedulerConfig):
        sched, keys = own, "strategy" if isinstance(strategy, SchedulerConfig) else None
    else:
        sched, keys = config.scheduler, "scheduler"
    if sched.policy == "sb":
        if keys is None:
            return max_model_len, (f"strategy {strategy.name} prefills a whole prompt, up to "
                                   "model.max_model_len, in one step")
        return max_model_len, (f"{keys}.policy sb computes a whole prompt, up to "
                               f"model.max_model_len, in one step; {keys}.policy hb with a "
                               f"smaller {keys}.max_num_batched_tokens computes it in chunks")
    chunk = min(sched.chunk_size or sched.max_num_batched_tokens, sched.max_num_batched_tokens,
                max_model_len)
    if keys is None:
        return chunk, (f"strategy {strategy.name} computes up to {chunk} tokens of a prompt a "
                       "step (its prefill token budget)")
    return chunk, (f"{keys}.policy hb computes up to {chunk} tokens of a prompt a step "
                   f"({keys}.chunk_size / {keys}.max_num_batched_tokens)")


def group_layout(layer_windows: Sequence[int], stages: Optional[Sequence[tuple[int, int]]] = None,
                 block_size: int = 16, max_model_len: int = 8192) -> Optional[KVGroupLayout]:
    """The groups of a model whose layers mix windowed and global attention; None for any
    other model (no window, or a window on every layer: one table as before). In one process
    (one stage) a page holds the smallest kind's count of layers (vLLM's uniform page) and each
    kind's layers go to its groups in layer order, so a page's slots hold neighbouring layers.

    `stages`: each pipeline stage's layer range. A stage stores, for every block, the slots its
    layers use, whichever group the block serves, so a group whose layers sit on one stage leaves
    the other stages' copies of its blocks unused (Gemma 3 1B at PP=2 in the one-stage layout
    stored all 4 slots of every block on both stages, half of them idle). The candidates beside
    that layout take up to c_s layers of a kind from every stage s into each group, in slots only
    stage s uses (the page is the sum of the c_s), with c_s = min(m, the stage's smallest kind)
    for m = 1, 2, ... The one kept costs a `max_model_len`-token request the fewest bytes on its
    fullest stage (slots the stage stores per block x the request's blocks), or, within 10% of
    that, has the fewest groups (each is one more table per sequence to grow every step: Gemma
    2 9B split 23 + 19 would save 5.5% with 23 groups instead of 2), so it is never dearer than
    the one-stage layout by more than that."""
    candidates = layout_candidates(layer_windows, stages)
    if not candidates or stages is None or len(stages) < 2:
        return candidates[0] if candidates else None
    return cheapest_layout(candidates, lambda layout: max(
        len(layout.slots_of(first, end)) for first, end in stages)
        * layout.blocks_per_sequence(max_model_len, block_size))


def layout_candidates(layer_windows: Sequence[int],
                      stages: Optional[Sequence[tuple[int, int]]] = None) -> list[KVGroupLayout]:
    """The layouts group_layout chooses among: the one-stage layout first, then, with two or
    more `stages`, the by-stage ones for m = 1, 2, ...; none for a model without hybrid
    windows."""
    kinds: dict[int, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(int(window), []).append(layer)
    if 0 not in kinds or len(kinds) < 2:
        return []
    one_stage = _paged_by_stage([kinds], min(len(layers) for layers in kinds.values()),
                                len(layer_windows))
    if stages is None or len(stages) < 2:
        return [one_stage]
    per_stage = [{w: [layer for layer in layers if first <= layer < end]
                  for w, layers in kinds.items()} for first, end in stages]
    most = max(min(len(ls) for ls in stage.values() if ls) for stage in per_stage)
    return [one_stage] + [_paged_by_stage(per_stage, m, len(layer_windows))
                          for m in range(1, most + 1)]


def cheapest_layout(candidates: Sequence[KVGroupLayout], cost) -> KVGroupLayout:
    """The candidate of least `cost(layout)`, or within 10% of it the one with the fewest groups
    (each is one more table per sequence to grow every step)."""
    costs = [(cost(layout), layout) for layout in candidates]
    least = min(c for c, _ in costs)
    return min(((layout.num_groups, c, layout) for c, layout in costs if c <= least * 1.1),
               key=lambda item: item[:2])[2]


def _paged_by_stage(per_stage: list[dict[int, list[int]]], m: int,
                    num_layers: int) -> KVGroupLayout:
    """Groups that take up to min(m, the stage's smallest kind) layers of their kind from each
    stage, in that stage's own slots."""
    widths = [min(m, min(len(ls) for ls in stage.values() if ls)) for stage in per_stage]
    offsets = [sum(widths[:s]) for s in range(len(widths))]
    windows: list[int] = []
    layer_group = [0] * num_layers
    layer_slot = [0] * num_layers
    for window in sorted(per_stage[0]):        # 0 first: the global layers anchor the tables
        count = max(-(-len(stage[window]) // width)
                    for stage, width in zip(per_stage, widths))
        for index in range(count):
            for stage, width, offset in zip(per_stage, widths, offsets):
                part = stage[window][index * width:(index + 1) * width]
                for slot, layer in enumerate(part, start=offset):
                    layer_group[layer], layer_slot[layer] = len(windows), slot
            windows.append(window)
    return KVGroupLayout(tuple(windows), tuple(layer_group), tuple(layer_slot), sum(widths))


def groups_for(config, arch, max_model_len: int = 8192,
               stages: Optional[Sequence[tuple[int, int]]] = None) -> Optional[KVGroupLayout]:
    """The layout the engine runs `arch` with under `config` (`stages`: the pipeline stages'
    layer ranges): None keeps one table per sequence (no hybrid windows;
    memory.free_outside_window false, the ablation; a strategy whose KV arithmetic counts one
    table per sequence, logged)."""
    layout = group_layout(arch.layer_windows, stages, config.cache.block_size, max_model_len)
    if layout is None or not config.cache.free_outside_window:
        return None
    strategy = config.strategy
    if strategy is not None and not strategy.kv_layer_groups:
        log.info("KV cache: strategy %s keeps every block of this model's windowed layers (it "
                 "moves one block table per sequence; the strategies that run a table per "
                 "layer group are listed in docs/engine.md, KV layer groups)", strategy.name)
        return None
    return layout


def check_group_capacity(layout: Optional[KVGroupLayout], num_blocks: int, block_size: int,
                         max_model_len: int, step: tuple[int, str] = (1, "decoding")) -> None:
    """A ConfigError where one max_model_len-token request, alone in the pool, cannot take the
    largest step the scheduler gives it (`step`: step_tokens' tokens and the settings that set
    them): it would never be scheduled, or would preempt itself forever, mid-run."""
    if layout is None:
        return
    tokens, setting = step
    need = layout.blocks_per_sequence(max_model_len, block_size, tokens)
    if need > num_blocks:
        from .errors import ConfigError

        raise ConfigError(f"the KV cache holds {num_blocks} blocks of {block_size} tokens (pages "
                          f"of {layout.page_layers} layers); a {max_model_len}-token request "
                          f"computing up to {tokens} tokens in a step holds up to {need} over "
                          f"its {layout.num_groups} layer groups ({setting}): raise "
                          "memory.kv_cache_memory, lower model.max_model_len or lower the "
                          "tokens of a step (the settings named above)")


def make_block_manager(layout: Optional[KVGroupLayout], num_blocks: int, block_size: int,
                       prefix_caching: bool, window: int = 0):
    """One replica's block manager: a table per layer group where the model runs with groups,
    else one table (released behind `window` when every layer has one)."""
    if layout is not None:
        from .group_blocks import GroupedBlockManager

        return GroupedBlockManager(num_blocks, block_size, layout.windows,
                                   prefix_caching=prefix_caching)
    from .kv_cache import BlockManager

    return BlockManager(num_blocks, block_size, prefix_caching=prefix_caching, window=window)


def kv_capacity(layout: Optional[KVGroupLayout], num_blocks: int, block_size: int,
                max_model_len: int) -> tuple[int, float]:
    """The pool's tokens for sequences that release nothing, and the decoding max_model_len-token
    requests it holds at once (the block managers' capacity_tokens / max_concurrency)."""
    if layout is None:
        return num_blocks * block_size, num_blocks * block_size / max_model_len
    return (num_blocks // layout.num_groups * block_size,
            num_blocks / layout.blocks_per_sequence(max_model_len, block_size))


def log_kv_cache(layout: Optional[KVGroupLayout], num_blocks: int, block_size: int,
                 max_model_len: int, kv_cache_bytes: int, window: int,
                 step: tuple[int, str] = (1, "decoding"), replicas: Optional[int] = None) -> None:
    """The start-up log's KV cache lines (one process, or `replicas` of the multi-process
    runtime): capacity and concurrency, then the layer groups or the window released."""
    capacity, concurrency = kv_capacity(layout, num_blocks, block_size, max_model_len)
    per = "" if replicas is None else f" per replica x {replicas}"
    log.info("KV cache: %d tokens%s (%d blocks of %d, %.2f GiB%s); maximum concurrency for "
             "%d-token requests: %.2fx%s", capacity, per, num_blocks, block_size,
             kv_cache_bytes / (1 << 30), "" if replicas is None else " in all", max_model_len,
             concurrency, "" if replicas is None else " per replica")
    if layout is None:
        from .kv_cache import log_kv_window

        log_kv_window(window)
        return
    windowed = sorted({w for w in layout.windows if w})
    per_request = layout.blocks_per_sequence(max_model_len, block_size, step[0])
    log.info("KV cache: %d layer groups of %d layers (windows %s): the windowed groups release "
             "a sequence's blocks behind their window, the global ones keep its context; a "
             "%d-token request holds up to %d blocks while a step computes %d of its tokens",
             layout.num_groups, layout.page_layers, "/".join(map(str, windowed)), max_model_len,
             per_request, step[0])
