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


def _transfer(groups, rng: random.Random, blocks_per_table: int):
    """A move's halves as kv_tiers lists them: table after table, a few blocks each."""
    counts = tuple(rng.randint(0, blocks_per_table) for _ in range(groups.num_groups))
    total = sum(counts)
    return (rng.sample(range(DEVICE_BLOCKS), total), rng.sample(range(2 * total + 1), total),
            counts)


def _paged(groups, arch, layout, rank, device_blocks, counts, fill: float = float("nan")):
    """The rank's paged cache, its slots of every block of the move holding their group's
    layers' values (what the rank's model wrote), every other slot `fill`."""
    view = shard_view(layout, rank, arch, groups)
    heads = slice(view.head_start, view.head_end)
    paged = torch.full((view.layer_end - view.layer_start, 2, DEVICE_BLOCKS,
                        view.head_end - view.head_start, BS, DIM), fill)
    return view, heads, paged


def _expected(groups, counts):
    """(order in the move, group) of each block, table after table."""
    return [group for group, count in enumerate(counts) for _ in range(count)]


def _check_rank(groups, arch, layout, rank, paged, view, device_blocks, counts):
    """Every layer of the rank holds, in each block of its group, that block's values (the
    rank's heads)."""
    first, end = layout.stage_range(layout.info(rank).stage)
    heads = slice(view.head_start, view.head_end)
    block_group = _expected(groups, counts)
    for layer in range(first, end):
        slot = groups.layer_slot[layer] - view.layer_start
        for order, (block, group) in enumerate(zip(device_blocks, block_group)):
            if group == groups.layer_group[layer]:
                torch.testing.assert_close(paged[slot, :, block], _value(layer, order)[:, heads])


def _round_trip(groups, arch, prefill: ParallelLayout, decode: ParallelLayout, seed: int,
                copier: str) -> None:
    """Every prefill rank copies its blocks of a move out, every decode rank copies them in
    (other device blocks): each decode rank's layers read what the prefill ranks' layers wrote."""
    rng = random.Random(seed)
    device_out, store_blocks, counts = _transfer(groups, rng, 3)
    store = allocate_store(len(store_blocks) * 2 + 1, groups.store_page_layers, HEADS, BS, DIM,
                           torch.float32).fill_(float("nan"))     # a slot nobody wrote shows
    block_group = _expected(groups, counts)
    for rank in range(prefill.world_size):
        view, heads, paged = _paged(groups, arch, prefill, rank, device_out, counts)
        first, end = prefill.stage_range(prefill.info(rank).stage)
        for layer in range(first, end):
            for order, (block, group) in enumerate(zip(device_out, block_group)):
                if group == groups.layer_group[layer]:
                    paged[groups.layer_slot[layer] - view.layer_start, :, block] = \
                        _value(layer, order)[:, heads]
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
        view, _, paged = _paged(groups, arch, decode, rank, device_in, counts, fill=-1.0)
        if copier == "cpu":
            swap_in(store, paged, view, device_in, store_blocks, counts)
        else:
            staged = paged[:, :, device_in].permute(2, 0, 1, 3, 4, 5).contiguous()
            from_store(store, view, staged, store_blocks, block_group)
            paged[:, :, device_in] = staged.permute(1, 2, 0, 3, 4, 5)
        _check_rank(groups, arch, decode, rank, paged, view, device_in, counts)


def _layout(tp: int, split: tuple[int, ...]) -> ParallelLayout:
    return ParallelLayout(tp=tp, pp=len(split), dp=1, layers_per_stage=split)


@pytest.mark.parametrize("copier", ["cpu", "cuda-host"])
@pytest.mark.parametrize("windows, prefill_split, decode_tp, decode_split", [
    ([4 if i % 2 == 0 else 0 for i in range(6)], (3, 3), 2, (6,)),     # Gemma 2 on 6 layers
    ([4] * 5 + [0], (5, 1), 2, (6,)),                                   # Gemma 3, 5 + 1
    ([4] * 5 + [0], (3, 3), 1, (4, 2)),
    ([0 if i % 6 == 5 else 4 for i in range(12)], (4, 4, 4), 1, (7, 5)),
])
def test_every_candidate_layout_moves_each_layer_to_the_ranks_of_the_other_layout(
        windows, prefill_split, decode_tp, decode_split, copier):
    """Each candidate whose stages' slots are one range, the one-stage layout included where
    two prefill stages share a slot for layers of different groups (Gemma 2 at 3 + 3: slot 1
    holds layer 2, windowed, on stage 0 and layer 3, global, on stage 1): every decode rank's
    layers read back what the prefill ranks' layers wrote, block by block, and no store slot
    holds a stage's write for another group (the store starts as NaN)."""
    arch = _arch(windows)
    prefill, decode = _layout(1, prefill_split), _layout(decode_tp, decode_split)
    stage_sets = [None, prefill.stage_ranges(), decode.stage_ranges()]
    candidates = {g for stages in stage_sets for g in layout_candidates(windows, stages)
                  if all(g.slot_range(*r) is not None
                         for lay in (prefill, decode) for r in lay.stage_ranges())}
    assert candidates
    for seed, groups in enumerate(sorted(candidates, key=repr)):
        _round_trip(groups, arch, prefill, decode, seed, copier)


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
