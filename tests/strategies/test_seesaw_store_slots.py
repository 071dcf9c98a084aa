"""Seesaw's CPU store with KV layer groups holds each block's own group's layers (issue 42): a
copy moves, per block, the pairs of paged-cache slot and store slot of the block's group, so
stages whose layers share a page slot (for different groups) never write each other's store
slots, and a store page is the largest group, not every slot a stage stores."""
from __future__ import annotations

import random

import pytest
import torch

from batchinfer.engine.kv_groups import group_layout, layout_candidates
from batchinfer.engine.runtime.layout import ParallelLayout
from batchinfer.resharding.cuda_kv_copies import from_store, to_store
from batchinfer.resharding.kv_store import allocate_store, swap_in, swap_out
from batchinfer.resharding.worker_layouts import shard_view

HEADS, BS, DIM = 2, 2, 3
DEVICE_BLOCKS = 24


def _arch(windows):
    from types import SimpleNamespace

    return SimpleNamespace(layer_windows=list(windows), num_layers=len(windows),
                           num_kv_heads=HEADS, head_dim=DIM)


def _value(layer: int, block: int) -> torch.Tensor:
    """What layer `layer` wrote into (store-order) block `block`: [2, heads, bs, D], distinct."""
    base = torch.arange(2 * HEADS * BS * DIM, dtype=torch.float32).view(2, HEADS, BS, DIM)
    return base + 1000 * layer + 100000 * block


def _transfer(groups, rng: random.Random):
    """A move's halves as kv_tiers lists them: table after table, 1-3 blocks each."""
    counts = tuple(rng.randint(1, 3) for _ in range(groups.num_groups))
    total = sum(counts)
    return (rng.sample(range(DEVICE_BLOCKS), total), rng.sample(range(2 * total + 1), total),
            counts)


def _paged(groups, arch, layout, rank, fill: float):
    """(the rank's ShardView, its paged cache with every slot `fill`)."""
    view = shard_view(layout, rank, arch, groups)
    return view, torch.full((view.layer_end - view.layer_start, 2, DEVICE_BLOCKS,
                             view.head_end - view.head_start, BS, DIM), fill)


def _block_groups(counts) -> list[int]:
    """Each block's group, in the move's order (table after table)."""
    return [group for group, count in enumerate(counts) for _ in range(count)]


def _rank_layers(groups, layout, rank, view) -> dict[int, int]:
    """The rank's paged slot (from its first) -> the layer of each group in it:
    {(slot, group): layer}."""
    first, end = layout.stage_range(layout.info(rank).stage)
    return {(groups.layer_slot[layer] - view.layer_start, groups.layer_group[layer]): layer
            for layer in range(first, end)}


def _check_rank(groups, layout, rank, paged, view, device_blocks, counts, other: float):
    """In each block of the move, each paged slot that holds a layer of the block's group holds
    that layer's values (the rank's heads), and every other slot `other`; blocks outside the
    move are untouched (-1)."""
    heads = slice(view.head_start, view.head_end)
    layers = _rank_layers(groups, layout, rank, view)
    moved = dict(zip(device_blocks, enumerate(_block_groups(counts))))
    for block in range(DEVICE_BLOCKS):
        for slot in range(paged.shape[0]):
            if block not in moved:
                assert (paged[slot, :, block] == -1).all(), (block, slot)
                continue
            order, group = moved[block]
            if (slot, group) in layers:
                torch.testing.assert_close(paged[slot, :, block],
                                           _value(layers[slot, group], order)[:, heads])
            else:
                assert (paged[slot, :, block] == other).all(), (block, slot, other)


def _round_trip(groups, arch, prefill: ParallelLayout, decode: ParallelLayout, seed: int,
                copier: str) -> None:
    """Every prefill rank copies its blocks of a move out, every decode rank copies them in
    (other device blocks): each decode rank's layers read what the prefill ranks' layers
    wrote, each store block holds its group's layers and nothing else, and a swap-in leaves a
    block's other slots as they were (CPU) or zeroed (the CUDA copier lands whole staging rows,
    so it zeroes what the row does not carry; its pinned staging starts as leftovers: NaN
    here)."""
    rng = random.Random(seed)
    device_out, store_blocks, counts = _transfer(groups, rng)
    store = allocate_store(len(store_blocks) * 2 + 1, groups.store_page_layers, HEADS, BS, DIM,
                           torch.float32).fill_(float("nan"))     # a slot nobody wrote shows
    block_group = _block_groups(counts)
    for rank in range(prefill.world_size):
        view, paged = _paged(groups, arch, prefill, rank, float("nan"))
        heads = slice(view.head_start, view.head_end)
        for (slot, group), layer in _rank_layers(groups, prefill, rank, view).items():
            for order, (block, block_group_) in enumerate(zip(device_out, block_group)):
                if block_group_ == group:
                    paged[slot, :, block] = _value(layer, order)[:, heads]
        if copier == "cpu":
            swap_out(store, paged, view, device_out, store_blocks, counts)
        else:        # the CUDA copier's host side: staged rows of the rank's whole block
            staged = paged[:, :, device_out].permute(2, 0, 1, 3, 4, 5).contiguous()
            to_store(store, view, staged, store_blocks, block_group)
    for order, (block, group) in enumerate(zip(store_blocks, block_group)):
        layers = [layer for layer, g in enumerate(groups.layer_group) if g == group]
        for slot in range(groups.store_page_layers):    # the group's layers, then untouched
            if slot < len(layers):
                torch.testing.assert_close(store[block, slot], _value(layers[slot], order))
            else:
                assert store[block, slot].isnan().all(), (block, slot)
    device_in = rng.sample(range(DEVICE_BLOCKS), len(device_out))
    for rank in range(decode.world_size):
        view, paged = _paged(groups, arch, decode, rank, -1.0)
        if copier == "cpu":
            swap_in(store, paged, view, device_in, store_blocks, counts)
        else:
            staged = torch.full((len(device_in), *paged[:, :, 0].shape), float("nan"))
            from_store(store, view, staged, store_blocks, block_group)
            paged[:, :, device_in] = staged.permute(1, 2, 0, 3, 4, 5)
        _check_rank(groups, decode, rank, paged, view, device_in, counts,
                    -1.0 if copier == "cpu" else 0.0)


def _layout(tp: int, split: tuple[int, ...]) -> ParallelLayout:
    return ParallelLayout(tp=tp, pp=len(split), dp=1, layers_per_stage=split)


@pytest.mark.parametrize("copier", ["cpu", "cuda-host"])
@pytest.mark.parametrize("windows, prefill_tp, prefill_split, decode_tp, decode_split", [
    ([4 if i % 2 == 0 else 0 for i in range(6)], 1, (3, 3), 2, (6,)),     # Gemma 2, 6 layers
    ([4] * 5 + [0], 1, (5, 1), 2, (6,)),                                  # Gemma 3, 5 + 1
    ([4] * 5 + [0], 1, (3, 3), 1, (4, 2)),
    ([4 if i % 2 == 0 else 0 for i in range(6)], 2, (6,), 1, (3, 3)),     # heads split out
    ([0 if i % 6 == 5 else 4 for i in range(12)], 1, (4, 4, 4), 1, (7, 5)),
])
def test_every_candidate_layout_moves_each_layer_to_the_ranks_of_the_other_layout(
        windows, prefill_tp, prefill_split, decode_tp, decode_split, copier):
    """Each candidate whose stages' slots are one range, the one-stage layout included where
    two prefill stages share a slot for layers of different groups (Gemma 2 at 3 + 3: slot 1
    holds layer 2, windowed, on stage 0 and layer 3, global, on stage 1): every decode rank's
    layers read back what the prefill ranks' layers wrote, block by block, and no store slot
    holds a stage's write for another group (the store starts as NaN)."""
    arch = _arch(windows)
    prefill, decode = _layout(prefill_tp, prefill_split), _layout(decode_tp, decode_split)
    stage_sets = [None, prefill.stage_ranges(), decode.stage_ranges()]
    candidates = {g for stages in stage_sets for g in layout_candidates(windows, stages)
                  if all(g.slot_range(*r) is not None
                         for lay in (prefill, decode) for r in lay.stage_ranges())}
    assert candidates
    for seed, groups in enumerate(sorted(candidates, key=repr)):
        _round_trip(groups, arch, prefill, decode, seed, copier)


def test_a_move_lists_its_blocks_per_table_as_the_tiers_hold_them():
    """`Transfer.table_blocks` tells the ranks each block's group: a prompt whose windowed
    tables released their first slots moves fewer blocks of those tables, and the count per
    table is what each table holds of the move, in the order the move lists them."""
    from batchinfer.engine.group_blocks import GroupedBlockManager
    from batchinfer.resharding.kv_store import block_groups
    from batchinfer.resharding.kv_tiers import KVTiers

    tiers = KVTiers(GroupedBlockManager(40, 4, (0, 8, 8)), GroupedBlockManager(80, 4, (0, 8, 8)))
    tiers.device.grow("a", 40)                           # 10 slots a table
    tiers.device.release_outside_window("a", 40)
    assert tiers.device.released_slots("a") == (0, 8, 8)
    out = tiers.swap_out("a", 36)                        # 9 slots: fewer than a table holds
    assert out.table_blocks == (9, 1, 1)
    tables = tiers.device.tables("a")
    assert [next(g for g, table in enumerate(tables) if block in table)
            for block in out.device_blocks] == block_groups(out.table_blocks)
    tiers.check_invariants()
    tiers.complete(out.transfer_id)
    back = tiers.swap_in("a", 36)
    assert back.table_blocks == out.table_blocks
    tiers.check_invariants()


def test_the_simulator_prices_a_copy_by_each_blocks_group():
    """A block of a group of one layer costs a quarter of one of four layers (Gemma 3 1B's
    one-stage layout: 4-layer groups and a last windowed one of 2)."""
    from types import SimpleNamespace

    from batchinfer.strategies.seesaw.build import copy_bytes_per_table

    arch = SimpleNamespace(kv_size=16, num_layers=26)
    groups = group_layout([0 if i % 6 == 5 else 512 for i in range(26)])
    per_table = copy_bytes_per_table(arch, 16, 4, groups)
    per_layer = 2 * 16 * 16 * 4
    assert per_table == (4 * per_layer,) * 6 + (2 * per_layer,)
    assert copy_bytes_per_table(arch, 16, 4, None) == (26 * per_layer,)


def test_a_store_page_is_the_largest_group():
    """Gemma 3's 5:1 pattern split 5 + 1: every group sits on one stage, so a store page is one
    layer where the by-stage page has a slot per stage (two); Gemma 3 1B's one-stage layout
    keeps 4 (its last windowed group has 2 layers)."""
    split = group_layout([4] * 5 + [0], [(0, 5), (5, 6)])
    assert split.store_page_layers == 1
    by_stage = [g for g in layout_candidates([4] * 5 + [0], [(0, 5), (5, 6)])
                if g.page_layers == 2]
    assert by_stage and all(g.store_page_layers == 1 for g in by_stage)
    gemma3_1b = group_layout([0 if i % 6 == 5 else 512 for i in range(26)])
    assert (gemma3_1b.page_layers, gemma3_1b.store_page_layers) == (4, 4)
    assert sorted(gemma3_1b.store_slot[layer] for layer in range(26)
                  if gemma3_1b.layer_group[layer] == gemma3_1b.num_groups - 1) == [0, 1]


def test_the_copy_pairs_of_a_stage_name_its_own_layers_only():
    """Gemma 2 on 6 layers, one-stage layout (pages of 3 slots), stages 3 + 3: each stage's
    pairs are its layers' slots from the stage's first slot and their places in the group."""
    groups = group_layout([4 if i % 2 == 0 else 0 for i in range(6)])
    assert groups.windows == (0, 4) and groups.layer_slot == (0, 0, 1, 1, 2, 2)
    assert groups.slot_range(0, 3) == (0, 2) and groups.slot_range(3, 6) == (1, 3)
    # stage 0: layer 1 (global, slot 0, store 0); layers 0, 2 (windowed, slots 0 and 1)
    assert groups.copy_slots(0, 3) == (((0,), (0,)), ((0, 1), (0, 1)))
    # stage 1: layers 3, 5 (global, slots 1 and 2 -> 0 and 1 from its first), layer 4
    assert groups.copy_slots(3, 6) == (((0, 1), (1, 2)), ((1,), (2,)))
    gapped = group_layout([0, 0, 0, 4, 4, 4])        # layers 2 and 3: slots 2 and 0
    assert gapped.slot_range(2, 4) is None
    with pytest.raises(ValueError, match="not one range"):
        gapped.copy_slots(2, 4)
