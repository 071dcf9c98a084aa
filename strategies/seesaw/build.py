"""Assembles a Seesaw engine: the two layouts over the same ranks, the device KV both fit, the
shared CPU store, one scheduler and the re-sharding executor."""
from __future__ import annotations

import logging
from typing import Optional

from batchinfer.engine.build import GiB, check_weights_fit
from batchinfer.engine.config import EngineConfig, ParallelConfig
from batchinfer.engine.engine import Engine, Replica
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.kv_groups import (KVGroupLayout, cheapest_layout, groups_for,
                                         layout_candidates, make_block_manager, step_tokens)
from batchinfer.engine.runtime.build import (check_capacity, engine_info, model_setup,
                                             per_rank_kv_budget, rank_bytes_per_block,
                                             start_workers)
from batchinfer.engine.runtime.layout import ParallelLayout, check_gpu_count, threads_per_rank
from .auto_layout import AUTO, allowed_decode, check_one_replica, decode_split
from .scheduler import DECODE, PREFILL, SeesawScheduler

from .executor import SeesawExecutor
from batchinfer.resharding.kv_store import allocate_store
from batchinfer.resharding.worker_layouts import LayoutSpec

from .worker import SeesawWorker, host_bytes

log = logging.getLogger("batchinfer")


def resolve_layouts(config: EngineConfig, params, arch) -> dict[str, ParallelLayout]:
    """c_p (the parallel section) and c_d (decode_tp x decode_pp, one of them may be left to the
    ranks) over the same ranks; a layout the model cannot take names its key and what is
    allowed."""
    par = config.parallel
    check_one_replica(par)
    ranks = par.tp * par.pp
    if params.prefill_layout == AUTO:
        raise ConfigError("strategy.prefill_layout: auto is resolved by `batchinfer run` from the "
                          "job's prompts before the engine is built; an engine built directly "
                          "takes the parallel section as c_p (prefill_layout: parallel)")
    decode_tp, decode_pp = decode_split(params, ranks, arch)
    prefill = ParallelLayout.resolve(par, arch)
    try:
        decode = ParallelLayout.resolve(ParallelConfig(
            tp=decode_tp, pp=decode_pp, pp_layers=params.decode_pp_layers,
            pp_balance=par.pp_balance), arch)
    except ConfigError as exc:
        reason = str(exc).split(": ", 1)[-1] if str(exc).startswith("parallel.") else str(exc)
        if str(exc).startswith("parallel.pp_layers"):
            raise ConfigError(f"strategy.decode_pp_layers: {reason}") from None
        raise ConfigError(f"strategy.decode_tp / decode_pp: {reason}; "
                          f"{allowed_decode(ranks, arch)}") from None
    return {PREFILL: prefill, DECODE: decode}


def sampling_rank(layouts: dict[str, ParallelLayout]) -> int:
    """The one rank that samples in every layout (the sampler keeps per-request state): on the
    last stage of each. Ranks are numbered stage-major, so the highest one always is; the first
    such rank is taken (prefill's usual sampler when decode's last stage has it too)."""
    common = set.intersection(*({lay.rank(0, lay.pp - 1, t) for t in range(lay.tp)}
                                for lay in layouts.values()))
    assert common, "the highest rank is on the last stage of every layout"
    return min(common)


def seesaw_groups(config: EngineConfig, arch, layouts: dict[str, ParallelLayout],
                  max_model_len: int) -> Optional[KVGroupLayout]:
    """The KV layer groups of a hybrid-window model under both layouts (one block manager and
    one store serve them; None: one table). Candidates: kv_groups.layout_candidates for one
    stage, for each layout's stages and for the stages both layouts' boundaries cut, kept where
    every rank's page slots are one range in both layouts (`_one_slot_range`: a rank's paged
    cache is viewed as that range); chosen as group_layout chooses (kv_groups.cheapest_layout):
    the fewest bytes a max_model_len-token request costs on the fullest rank of either layout,
    or within 10% of that the fewest groups. Stages may share page slots: a copy moves each
    block's own group's layers to their own store slots (kv_store.py)."""
    if groups_for(config, arch, max_model_len) is None:
        return None
    stage_sets = [None] + [lay.stage_ranges() for lay in layouts.values()]
    # the stages both layouts' boundaries cut the layers into: a by-stage layout over these gives
    # every stage of either layout its own run of slots, where the two splits do not line up
    cuts = sorted({start for lay in layouts.values() for start, _ in lay.stage_ranges()}
                  | {arch.num_layers})
    stage_sets.append(list(zip(cuts, cuts[1:])))
    candidates = dict.fromkeys(layout for stages in stage_sets
                               for layout in layout_candidates(arch.layer_windows, stages))
    usable = [g for g in candidates if all(_one_slot_range(g, lay) for lay in layouts.values())]
    if not usable:
        log.info("KV cache: Seesaw keeps every block of this model's windowed layers (no layout "
                 "of its layer groups gives each stage of %s one range of page slots)",
                 " and ".join(lay.describe() for lay in layouts.values()))
        return None
    block_size = config.cache.block_size
    return cheapest_layout(usable, lambda groups: max(
        rank_bytes_per_block(lay, arch, r, block_size, 1, groups)
        for lay in layouts.values() for r in range(lay.world_size))
        * groups.blocks_per_sequence(max_model_len, block_size))


def _one_slot_range(groups: KVGroupLayout, layout: ParallelLayout) -> bool:
    """Every stage's page slots are one range (its paged cache is that slice of a page)."""
    return all(groups.slot_range(*stage) is not None for stage in layout.stage_ranges())


def tier_blocks(config: EngineConfig, params, arch, layouts: dict[str, ParallelLayout],
                per_rank: int, dtype_bytes: int, max_model_len: int,
                groups: Optional[KVGroupLayout] = None) -> tuple[int, int, int]:
    """-> (device blocks, bytes of a device block, store blocks). Every rank gets the same block
    count; a block is as big as the rank's larger shard of either layout (with KV layer groups,
    of the page slots its layers use). The store holds cpu_kv_cache_memory of whole-model KV
    (a store block: every layer, or with groups its group's layers, of all heads; with the
    tier off: as many blocks as the device). The simulator sizes its Seesaw with this too."""
    block_size = config.cache.block_size
    block_bytes = max(rank_bytes_per_block(lay, arch, r, block_size, dtype_bytes, groups)
                      for lay in layouts.values() for r in range(lay.world_size))
    num_blocks = per_rank // block_bytes
    # a stored sequence comes back only with a free block per table kept beside it
    check_capacity(num_blocks - (groups.num_groups if groups else 1), block_size, max_model_len,
                   groups, step_tokens(config, max_model_len))
    if not params.cpu_kv_tier:
        return num_blocks, block_bytes, num_blocks
    store_block_bytes = store_bytes_per_block(arch, block_size, dtype_bytes, groups)
    store_blocks = int(params.cpu_kv_cache_memory) // store_block_bytes
    if store_blocks < num_blocks:
        raise ConfigError(
            f"strategy.cpu_kv_cache_memory: {params.cpu_kv_cache_memory} bytes hold "
            f"{store_blocks} blocks of {block_size} tokens, fewer than the device cache's "
            f"{num_blocks}; the store must take every decoding sequence at a switch (a block "
            f"takes {store_block_bytes} bytes)")
    return num_blocks, block_bytes, store_blocks


def seesaw_scheduler(config: EngineConfig, params, arch, layouts: dict[str, ParallelLayout],
                     groups: Optional[KVGroupLayout], num_blocks: int, store_blocks: int,
                     max_model_len: int) -> SeesawScheduler:
    """The scheduler over both tiers' block managers (the engine's and the simulator's): a
    table per layer group, or one table released behind a window every layer has."""
    window = config.cache.kv_window(arch)
    return SeesawScheduler(
        make_block_manager(groups, num_blocks, config.cache.block_size, False, window),
        make_block_manager(groups, store_blocks, config.cache.block_size, False, window),
        params.max_num_seqs, params.max_num_batched_tokens, max_model_len,
        prefill_depth=layouts[PREFILL].pp, decode_depth=layouts[DECODE].pp,
        policy=params.schedule)


def store_bytes_per_block(arch, block_size: int, dtype_bytes: int,
                          groups: Optional[KVGroupLayout] = None) -> int:
    """A CPU store block: K and V of every layer (with KV layer groups, of the largest group's
    layers: a block holds its own group's)."""
    return max(copy_bytes_per_table(arch, block_size, dtype_bytes, groups))


def copy_bytes_per_table(arch, block_size: int, dtype_bytes: int,
                         groups: Optional[KVGroupLayout] = None) -> tuple[int, ...]:
    """What a copy moves per block of each table: K and V of every layer, or with KV layer
    groups of the table's group's layers."""
    per_layer = 2 * arch.kv_size * block_size * dtype_bytes
    sizes = groups.group_sizes if groups is not None else (arch.num_layers,)
    return tuple(per_layer * layers for layers in sizes)


def check_no_prefix_caching(config: EngineConfig) -> None:
    if config.cache.enable_prefix_caching:
        raise ConfigError("memory.enable_prefix_caching: strategy seesaw moves KV between its "
                          "tiers by sequence and does not share cached blocks; set it to false "
                          "(supported by baseline, tdpipe, gllm, sipipe, sidp)")


def build_seesaw_engine(config: EngineConfig, params) -> Engine:
    check_no_prefix_caching(config)
    setup = model_setup(config)
    arch, block_size = setup.arch, config.cache.block_size
    layouts = resolve_layouts(config, params, arch)
    prefill = layouts[PREFILL]
    check_gpu_count(config.parallel, setup.device.type, prefill.world_size)
    per_rank = per_rank_kv_budget(config, prefill, arch, setup.device, setup.dtype_bytes)
    kv_bytes = setup.kv_dtype.itemsize
    groups = seesaw_groups(config, arch, layouts, setup.max_model_len)
    num_blocks, block_bytes, store_blocks = tier_blocks(config, params, arch, layouts, per_rank,
                                                        kv_bytes, setup.max_model_len, groups)
    store_block_bytes = store_bytes_per_block(arch, block_size, kv_bytes, groups)
    # refused before the store's pages are touched (4 GiB by default), not after
    check_weights_fit(config, arch, setup.device, setup.dtype, copies=config.parallel.dp,
                      host_copy=host_bytes(arch, list(layouts.values()), prefill.world_size,
                                           config.model.load_format == "dummy",
                                           store_blocks * store_block_bytes))
    store = allocate_store(store_blocks, groups.store_page_layers if groups else arch.num_layers,
                           arch.num_kv_heads, block_size, arch.head_dim, setup.kv_dtype)
    threads = threads_per_rank(config.parallel, prefill.world_size, config.device.num_threads)
    layout_spec = LayoutSpec(layouts, PREFILL, sampling_rank(layouts), store,
                             async_swap=params.async_pipeline, kv_groups=groups)
    pool = start_workers(config, setup, prefill, num_blocks, threads,
                         extension=SeesawWorker(layout_spec), kv_groups=groups)
    scheduler = seesaw_scheduler(config, params, arch, layouts, groups, num_blocks, store_blocks,
                                 setup.max_model_len)
    device_blocks, store_tables = scheduler.block_manager, scheduler.tiers.store
    executor = SeesawExecutor(pool, prefill, 0, device_blocks, config.parallel.step_timeout_seconds,
                              layouts=layouts, initial=PREFILL)
    info = engine_info(config, setup, prefill, num_blocks, threads,
                       num_blocks * block_bytes * prefill.world_size, kv_groups=groups)
    info["seesaw"] = {"prefill_layout": {"tp": prefill.tp, "pp": prefill.pp},
                      "decode_layout": {"tp": layouts[DECODE].tp, "pp": layouts[DECODE].pp},
                      "cpu_store_tokens": store_tables.capacity_tokens,
                      "cpu_store_bytes": store_blocks * store_block_bytes,
                      "cpu_store_page_layers": (groups.store_page_layers if groups
                                                else arch.num_layers),
                      "schedule": params.schedule, "cpu_kv_tier": params.cpu_kv_tier,
                      "async_pipeline": params.async_pipeline}
    log.info("Seesaw: prefill %s, decode %s; CPU KV store %d tokens (%.2f GiB)",
             prefill.describe(), layouts[DECODE].describe(), store_tables.capacity_tokens,
             store_blocks * store_block_bytes / GiB)
    return Engine([Replica(scheduler, executor)], setup.tokenizer, setup.max_model_len,
                  info["model_id"], info)
