"""Seesaw with KV layer groups (issue 42): both tiers keep a table per group, a move pairs only the
blocks the windows still hold, the schedule runs to the end with the windowed tables releasing,
and a tiny Gemma 3 (Gemma 3's 5:1 windowed / global pattern on 6 layers) gives transformers'
greedy tokens through prefill at PP=2, the CPU store and decode at TP=2."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine.group_blocks import GroupedBlockManager
from batchinfer.engine.kv_cache import BlockManager
from batchinfer.engine.kv_groups import blocks_held, group_layout
from batchinfer.resharding.kv_tiers import KVTiers, held_blocks
from batchinfer.strategies.seesaw.scheduler import SeesawScheduler
from batchinfer.sim.scheduler_driver import make_seq
from tests.strategies.test_seesaw import drive, exercise_tiers

WINDOWS = (0, 8, 8)          # a global group and two windowed ones of 8 keys
BS = 4


def _tiers(device_blocks: int = 30, store_blocks: int = 60, groups: bool = True) -> KVTiers:
    """Tiers over the layer groups, or (groups False) over one table of a model windowed on
    every layer (8 keys)."""
    if groups:
        return KVTiers(GroupedBlockManager(device_blocks, BS, WINDOWS),
                       GroupedBlockManager(store_blocks, BS, WINDOWS))
    return KVTiers(BlockManager(device_blocks, BS, window=8),
                   BlockManager(store_blocks, BS, window=8))


def test_blocks_held_is_what_the_manager_holds_after_the_release():
    for tokens in range(1, 60):
        bm = GroupedBlockManager(200, BS, WINDOWS)
        bm.grow("a", tokens)
        bm.release_outside_window("a", tokens)
        assert bm.num_held_blocks("a") == blocks_held(WINDOWS, tokens, BS), tokens
    assert blocks_held((0,), 9, BS) == 3


def test_a_prefilled_sequence_moves_only_what_its_windows_still_need():
    """40 tokens in blocks of 4: the global table holds 10 blocks, each windowed one the 2 that
    hold keys 32-39 (a query at 40 sees 33-40): 14 blocks move, not 30, and come back with the
    same shape; decoding on, the windowed tables grow and release as before the trip."""
    tiers = _tiers()
    device, store = tiers.device, tiers.store
    device.grow("a", 40)
    device.release_outside_window("a", 40)
    assert device.released_slots("a") == (0, 8, 8) and device.num_held_blocks("a") == 14
    out = tiers.swap_out("a", 40)
    assert len(out.device_blocks) == len(out.store_blocks) == 14
    assert store.released_slots("a") == (0, 8, 8) and store.num_held_blocks("a") == 14
    assert out.device_blocks == held_blocks(device, "a", 10)
    tiers.check_invariants()
    tiers.complete(out.transfer_id)
    assert device.num_free_blocks == 30 and tiers.can_swap_in(40, keep_free_sequences=5)
    assert not tiers.can_swap_in(40, keep_free_sequences=6)     # 14 + 6 x 3 tables > 30
    back = tiers.swap_in("a", 40)
    assert back.store_blocks == out.store_blocks and len(back.device_blocks) == 14
    assert device.released_slots("a") == (0, 8, 8)
    tiers.check_invariants()
    tiers.complete(back.transfer_id)
    assert store.num_free_blocks == 60
    device.grow("a", 41)                       # a new slot in every table
    assert device.num_held_blocks("a") == 17
    assert device.release_outside_window("a", 41) == 0
    device.grow("a", 44)
    assert device.release_outside_window("a", 44) == 2     # keys 36-43 from a query at 44
    device.free("a")
    device.check_invariants()
    assert device.num_free_blocks == 30


def test_a_model_windowed_on_every_layer_moves_its_window_only():
    tiers = _tiers(groups=False)
    tiers.device.grow("a", 40)
    tiers.device.release_outside_window("a", 40)
    out = tiers.swap_out("a", 40)
    assert len(out.store_blocks) == 2 and tiers.store.released_slots("a") == (8,)
    tiers.complete(out.transfer_id)
    back = tiers.swap_in("a", 40)
    assert len(back.device_blocks) == 2 and tiers.device.released_slots("a") == (8,)


def test_tiers_refuse_managers_over_other_windows():
    with pytest.raises(ValueError, match="windows"):
        KVTiers(GroupedBlockManager(10, BS, WINDOWS), BlockManager(10, BS))


moves = st.lists(st.tuples(st.sampled_from(["admit", "decode", "out", "in", "done", "finish"]),
                           st.integers(0, 5), st.integers(1, 40)), max_size=150)


@settings(max_examples=300, deadline=None)
@given(moves, st.booleans())
def test_windowed_tiers_never_leak_or_double_allocate(operations, groups):
    exercise_tiers(_tiers(groups=groups), operations)


def _workload():
    return [make_seq(i, 30 + (i * 17) % 50, 20 + (i * 11) % 40) for i in range(24)]


@pytest.mark.parametrize("policy", ["transition_minimizing", "prefill_prioritizing",
                                    "decode_prioritizing"])
def test_the_schedule_finishes_with_groups_and_decodes_more_at_once(policy):
    """The same bytes of device KV and store: as a page of 2 layers in three groups (a global
    one, two windowed of 8 keys), or as one table of the 6 layers (a block 3x the bytes). With
    the groups, long sequences hold a few blocks in the windowed tables, so more of them decode
    on the device at once and fewer layout switches are needed."""
    peaks = {}
    for name, device, store in (("groups", GroupedBlockManager(120, BS, WINDOWS),
                                 GroupedBlockManager(240, BS, WINDOWS)),
                                ("one table", BlockManager(40, BS), BlockManager(80, BS))):
        sched = SeesawScheduler(device, store, max_num_seqs=64, max_num_batched_tokens=256,
                                max_model_len=128, prefill_depth=2, decode_depth=1,
                                policy=policy)
        seqs = _workload()
        for seq in seqs:
            sched.add(seq)
        most = [0]
        on_result = sched.on_result

        def watched(batch, on_result=on_result, sched=sched, most=most):
            most[0] = max(most[0], len(sched.running))
            on_result(batch)

        sched.on_result = watched
        freed_in_decode = [0]
        release = device.release_outside_window

        def counted(seq_id, first_query, release=release, sched=sched, freed=freed_in_decode):
            released = release(seq_id, first_query)
            freed[0] += released if sched.phase == "decode" else 0
            return released

        device.release_outside_window = counted
        switches = drive(sched)
        assert all(seq.is_finished for seq in seqs)
        if name == "groups":    # decoding sequences release a block per 4 tokens per group
            decoded = sum(seq.request.sampling.max_tokens for seq in seqs)
            assert freed_in_decode[0] > decoded // BS
        assert device.num_free_blocks == device.num_blocks
        assert store.num_free_blocks == store.num_blocks
        peaks[name] = (most[0], len(switches))
    assert peaks["groups"][0] > peaks["one table"][0], peaks
    assert peaks["groups"][1] <= peaks["one table"][1], peaks


def _layouts(prefill: tuple[int, ...], decode_tp: int, decode: tuple[int, ...]) -> dict:
    from batchinfer.engine.runtime.layout import ParallelLayout

    return {"prefill": ParallelLayout(tp=1, pp=len(prefill), dp=1, layers_per_stage=prefill),
            "decode": ParallelLayout(tp=decode_tp, pp=len(decode), dp=1,
                                     layers_per_stage=decode)}


def _chosen(windows: list[int], layouts: dict, max_model_len: int = 8192):
    from types import SimpleNamespace

    from batchinfer.engine.config import EngineConfig
    from batchinfer.strategies.seesaw.build import seesaw_groups
    from batchinfer.strategies.seesaw.params import SeesawParams

    arch = SimpleNamespace(layer_windows=windows, num_layers=len(windows), num_kv_heads=8,
                           head_dim=16, num_attention_heads=16)
    config = EngineConfig(cache={"block_size": 16}, strategy=SeesawParams())
    return seesaw_groups(config, arch, layouts, max_model_len)


def _even(layers: int, parts: int) -> tuple[int, ...]:
    return tuple(layers // parts + (i < layers % parts) for i in range(parts))


def test_stages_may_share_a_page_slot_now_that_a_copy_moves_its_group_only():
    """The one-stage layout of Gemma 2's pattern on 6 layers at PP=2 (3 + 3) gives two stages
    slot 1 (layer 2, windowed, on stage 0; layer 3, global, on stage 1). A copy writes only a
    block's own group's layers, each to its own store slot (tests/strategies/
    test_seesaw_store_slots.py), so the layout is usable, and at the by-stage layouts' cost
    with fewer groups it is the one kept."""
    windows = [16 if i % 2 == 0 else 0 for i in range(6)]
    layouts = _layouts((3, 3), 2, (6,))
    one_stage = group_layout(windows)
    assert [one_stage.slot_range(*r) for r in ((0, 3), (3, 6))] == [(0, 2), (1, 3)]
    assert _chosen(windows, layouts, 256) == one_stage


@pytest.mark.parametrize("pattern", ["gemma2", "gemma3", "gpt-oss"])
@pytest.mark.parametrize("layers", [24, 26, 42, 62])
@pytest.mark.parametrize("prefill_pp, decode_tp, decode_pp",
                         [(2, 2, 1), (2, 1, 2), (4, 4, 1), (4, 2, 2), (8, 4, 2), (8, 8, 1)])
def test_every_layout_pair_gets_groups_with_one_slot_range_per_stage(pattern, layers, prefill_pp,
                                                                     decode_tp, decode_pp):
    """Splits that do not line up (26 layers: 7 + 7 + 6 + 6 against 13 + 13) included: every
    stage of either layout views its paged cache as one range of page slots (the copies between
    such layouts: tests/strategies/test_seesaw_store_slots.py)."""
    period = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}[pattern]
    windows = [0 if i % period == period - 1 else 512 for i in range(layers)]
    layouts = _layouts(_even(layers, prefill_pp), decode_tp, _even(layers, decode_pp))
    groups = _chosen(windows, layouts)
    assert groups is not None
    assert all(groups.slot_range(*stage) is not None
               for lay in layouts.values() for stage in lay.stage_ranges())


def test_the_device_keeps_a_block_per_table_for_a_sequence_coming_back():
    """Gemma 2 with max_model_len = its window: a stored sequence holds its whole context in
    both tables, and comes back only with a free block per table beside it; the device must
    hold that beside the largest step (9 blocks did not: a 60-token sequence in the store
    and a new prompt stalled the schedule)."""
    from types import SimpleNamespace

    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.errors import ConfigError
    from batchinfer.strategies.seesaw.build import tier_blocks
    from batchinfer.strategies.seesaw.params import SeesawParams

    arch = SimpleNamespace(layer_windows=[64, 0], num_layers=2, num_kv_heads=1, head_dim=8,
                           kv_size=8)
    groups = group_layout(arch.layer_windows, None, 16, 64)
    params = SeesawParams(cpu_kv_tier=False)
    config = EngineConfig(cache={"block_size": 16}, strategy=params,
                          scheduler=params.scheduler_config())
    layouts = _layouts((2,), 1, (2,))
    block = 2 * 1 * 8 * 16 * 4                        # a page of one layer, fp32
    with pytest.raises(ConfigError, match="64-token request"):
        tier_blocks(config, params, arch, layouts, 9 * block, 4, 64, groups)
    assert tier_blocks(config, params, arch, layouts, 10 * block, 4, 64, groups)[0] == 10

    device, store = (GroupedBlockManager(n, 16, groups.windows) for n in (10, 40))
    sched = SeesawScheduler(device, store, max_num_seqs=8, max_num_batched_tokens=64,
                            max_model_len=64)
    first = make_seq(0, 16, 47)
    sched.add(first)
    while first.num_computed_tokens < 60:
        drive_one_step(sched)
    sched.add(make_seq(1, 16, 4))
    drive(sched)
    assert device.num_free_blocks == 10


def drive_one_step(sched: SeesawScheduler) -> None:
    """Launches what the scheduler gives, reports its copies done, completes the batches."""
    from batchinfer.resharding.kv_tiers import Transfer
    from batchinfer.sim.scheduler_driver import complete, launch

    batches = launch(sched)
    done = [a.transfer_id for a in sched.take_actions() if isinstance(a, Transfer)]
    sched.on_transfers_done(done)
    for batch in batches:
        complete(sched, batch)


def test_the_layout_serves_both_layouts_with_one_slot_range_per_rank():
    """Gemma 3's pattern on 6 layers, prefill PP=2 (3 + 3), decode TP=2: the stage layout (4
    groups, a page of 2 slots, one per stage) is kept; each rank's slots are one range."""
    from types import SimpleNamespace

    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.runtime.layout import ParallelLayout
    from batchinfer.strategies.seesaw.build import seesaw_groups
    from batchinfer.strategies.seesaw.params import SeesawParams

    windows = [16] * 5 + [0]
    arch = SimpleNamespace(layer_windows=windows, num_layers=6, num_kv_heads=2, head_dim=16,
                           num_attention_heads=4)
    config = EngineConfig(cache={"block_size": 16}, strategy=SeesawParams(decode_tp=2))
    layouts = {"prefill": ParallelLayout(tp=1, pp=2, dp=1, layers_per_stage=(3, 3)),
               "decode": ParallelLayout(tp=2, pp=1, dp=1, layers_per_stage=(6,))}
    groups = seesaw_groups(config, arch, layouts, 256)
    assert groups == group_layout(windows, [(0, 3), (3, 6)], 16, 256)
    assert groups.num_groups == 4 and groups.page_layers == 2
    assert groups.slot_range(0, 3) == (0, 1) and groups.slot_range(3, 6) == (1, 2)
    assert groups.slot_range(0, 6) == (0, 2)


@pytest.fixture(scope="module")
def six_layer_windows(tmp_path_factory, default_model_dir):
    """Tiny Gemma 3 (its 5:1 pattern) and Gemma 2 (windowed and global alternating), 6 layers,
    16-key windows -> family -> (model directory, transformers' greedy tokens for the window
    tests' PROMPTS)."""
    from tests.tiny_families import hf_model, saved_with_greedy
    from tests.window_engines import MAX_NEW, PROMPTS

    models = {"gemma3": hf_model("gemma3", num_hidden_layers=6,
                                 layer_types=["sliding_attention"] * 5 + ["full_attention"]),
              "gemma2": hf_model("gemma2", num_hidden_layers=6)}
    return {name: saved_with_greedy(model, tmp_path_factory.mktemp(name), default_model_dir,
                                    PROMPTS, MAX_NEW) for name, model in models.items()}


@pytest.mark.slow
@pytest.mark.parametrize("family, split, windows, page, store_page, units, blocks", [
    ("gemma3", (3, 3), [0, 16, 16, 16], 2, 2, 2, (40, 48)),
    ("gemma3", (5, 1), [0, 16, 16, 16, 16, 16], 1, 1, 2, (54, 54)),
    ("gemma2", (3, 3), [0, 16], 3, 3, 4, (20, 20))])
def test_seesaw_runs_the_groups_through_both_layouts_and_gives_transformers_tokens(
        six_layer_windows, family, split, windows, page, store_page, units, blocks):
    """Prefill at PP=2, decode at TP=2 (a head each). Gemma 3 at 3 + 3: the stage layout's 4
    groups in pages of 2 slots, one per prefill stage, both on every decode rank. Gemma 3 at
    5 + 1: 6 groups of one layer, so a store page holds one layer. Gemma 2: the one-stage
    layout's 2 groups in pages of 3 slots, slot 1 shared by a windowed layer of stage 0 and a
    global one of stage 1 (each writes its group's blocks only). The prompts and 40 tokens
    each run far past the 16-key window, a small CPU store makes the layouts switch several
    times, and every token equals transformers'. `units`: slots x heads of a rank's device
    block in its larger shard; `blocks`: the device's and the store's (a 128-token prompt's
    step takes 8 slots of each table)."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.strategies.seesaw.params import SeesawParams
    from tests.greedy import greedy_tokens
    from tests.window_engines import BLOCK, MAX_NEW, PROMPTS

    path, expected = six_layer_windows[family]
    slot = 2 * 16 * BLOCK * 4                 # K and V of one head of one layer, fp32
    params = SeesawParams(decode_tp=2, decode_pp=1,
                          cpu_kv_cache_memory=blocks[1] * store_page * 2 * slot,
                          max_num_batched_tokens=256)
    config = EngineConfig(model={"path": str(path), "max_model_len": 128},
                          cache={"kv_cache_memory": str(blocks[0] * units * slot),
                                 "block_size": BLOCK},
                          parallel={"pp": 2, "pp_layers": list(split),
                                    "step_timeout_seconds": 120},
                          scheduler=params.scheduler_config(), strategy=params)
    with Engine.from_config(config) as engine:
        sched = engine.scheduler
        assert engine.info["kv_groups"]["windows"] == windows
        assert engine.info["kv_groups"]["page_layers"] == page
        assert engine.info["seesaw"]["cpu_store_page_layers"] == store_page
        assert (sched.block_manager.num_blocks, sched.tiers.store.num_blocks) == blocks
        assert greedy_tokens(engine, PROMPTS * 2, batched=True, max_new=MAX_NEW) == expected * 2
        events = engine.drain_step_events()
        stats = engine.stats()
        sched.check_invariants()
        assert (sched.block_manager.num_free_blocks, sched.tiers.store.num_free_blocks) == blocks
    switches = [d for e in events for d in e.get("decisions", ())]
    assert len(switches) >= 3, switches
    assert stats["kv_window_freed_blocks"] > 0
    assert stats["strategy_stats"]["swapped_in_tokens"] > 0


@pytest.fixture(scope="module")
def phi3_windowed(tmp_path_factory, default_model_dir):
    """A tiny Phi-3 with a 16-key window on every layer -> (directory, transformers' tokens)."""
    from tests.tiny_families import TINY, saved_with_greedy, tiny_model
    from tests.window_engines import MAX_NEW, PROMPTS

    model = tiny_model("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 16})
    assert model.config.num_hidden_layers == TINY["num_hidden_layers"] == 2
    return saved_with_greedy(model, tmp_path_factory.mktemp("phi3-windowed"), default_model_dir,
                             PROMPTS, MAX_NEW)


@pytest.mark.slow
def test_seesaw_keeps_a_window_of_a_model_windowed_on_every_layer(phi3_windowed):
    """One table, released behind the window in both tiers: the 8 sequences' prompts (432
    tokens) pass through a store of 16 blocks (256 tokens) in one prefill phase, each holding
    the two or three blocks its window needs, and the tokens equal transformers'."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine
    from batchinfer.strategies.seesaw.params import SeesawParams
    from tests.greedy import greedy_tokens
    from tests.window_engines import BLOCK, MAX_NEW, PROMPTS

    path, expected = phi3_windowed
    store_block = 2 * 2 * 2 * 16 * BLOCK * 4        # 2 layers x K, V x 2 heads x 16, fp32
    params = SeesawParams(decode_tp=2, decode_pp=1, cpu_kv_cache_memory=16 * store_block)
    config = EngineConfig(model={"path": str(path), "max_model_len": 128},
                          cache={"kv_cache_memory": str(12 * store_block // 2),
                                 "block_size": BLOCK},
                          parallel={"pp": 2, "step_timeout_seconds": 120},
                          scheduler=params.scheduler_config(), strategy=params)
    with Engine.from_config(config) as engine:
        sched = engine.scheduler
        assert engine.info["kv_window"] == 16 and "kv_groups" not in engine.info
        assert sched.block_manager.num_blocks == 12 and sched.tiers.store.num_blocks == 16
        assert greedy_tokens(engine, PROMPTS * 2, batched=True, max_new=MAX_NEW) == expected * 2
        events = engine.drain_step_events()
        stats = engine.stats()
    switches = [d for e in events for d in e.get("decisions", ())]
    assert [s["switch"] for s in switches][:1] == ["prefill->decode"]
    assert switches[0]["waiting"] == 0 and switches[0]["in_store"] == 8
    assert stats["kv_window_freed_blocks"] > 0
