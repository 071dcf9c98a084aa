"""Assembles a Seesaw engine: the two layouts over the same ranks, the device KV both fit, the
shared CPU store, one scheduler and the re-sharding executor."""
from __future__ import annotations

import logging

from batchinfer.engine.build import GiB
from batchinfer.engine.config import EngineConfig, ParallelConfig
from batchinfer.engine.engine import Engine, Replica
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.kv_cache import BlockManager
from batchinfer.engine.runtime.build import (check_capacity, check_gpus, engine_info, model_setup,
                                             per_rank_kv_budget, rank_bytes_per_block,
                                             start_workers)
from batchinfer.engine.runtime.layout import ParallelLayout, threads_per_rank
from .auto_layout import AUTO, allowed_decode, check_one_replica, decode_split
from .scheduler import DECODE, PREFILL, SeesawScheduler

from .executor import SeesawExecutor
from batchinfer.resharding.kv_store import allocate_store
from batchinfer.resharding.worker_layouts import LayoutSpec

from .worker import SeesawWorker

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


def tier_blocks(config: EngineConfig, params, arch, layouts: dict[str, ParallelLayout],
                per_rank: int, dtype_bytes: int, max_model_len: int) -> tuple[int, int, int]:
    """-> (device blocks, bytes of a device block, store blocks). Every rank gets the same block
    count; a block is as big as the rank's larger shard of either layout. The store holds
    cpu_kv_cache_memory of whole-model KV (with the tier off: what the device holds). The
    simulator sizes its Seesaw with this too."""
    block_size = config.cache.block_size
    block_bytes = max(rank_bytes_per_block(lay, arch, r, block_size, dtype_bytes)
                      for lay in layouts.values() for r in range(lay.world_size))
    num_blocks = per_rank // block_bytes
    check_capacity(num_blocks - 1, block_size, max_model_len)
    token_bytes = arch.kv_bytes_per_token(dtype_bytes)
    if not params.cpu_kv_tier:
        return num_blocks, block_bytes, num_blocks
    store_blocks = int(params.cpu_kv_cache_memory) // (token_bytes * block_size)
    if store_blocks < num_blocks:
        raise ConfigError(
            f"strategy.cpu_kv_cache_memory: {params.cpu_kv_cache_memory} bytes hold "
            f"{store_blocks * block_size} tokens, fewer than the device cache's "
            f"{num_blocks * block_size}; the store must take every decoding sequence at a "
            f"switch (one token takes {token_bytes} bytes)")
    return num_blocks, block_bytes, store_blocks


def build_seesaw_engine(config: EngineConfig, params) -> Engine:
    if config.cache.enable_prefix_caching:
        raise ConfigError("cache.enable_prefix_caching: strategy seesaw moves KV between its "
                          "tiers by sequence and does not share cached blocks; set it to false "
                          "(supported by baseline, tdpipe, gllm, sipipe, sidp)")
    setup = model_setup(config)
    arch, block_size = setup.arch, config.cache.block_size
    layouts = resolve_layouts(config, params, arch)
    prefill = layouts[PREFILL]
    check_gpus(setup, prefill.world_size)
    per_rank = per_rank_kv_budget(config, prefill, arch, setup.device, setup.dtype_bytes)
    kv_bytes = setup.kv_dtype.itemsize
    num_blocks, block_bytes, store_blocks = tier_blocks(config, params, arch, layouts, per_rank,
                                                        kv_bytes, setup.max_model_len)
    token_bytes = arch.kv_bytes_per_token(kv_bytes)
    store = allocate_store(store_blocks, arch.num_layers, arch.num_kv_heads, block_size,
                           arch.head_dim, setup.kv_dtype)
    threads = threads_per_rank(config.parallel, prefill.world_size, config.device.num_threads)
    layout_spec = LayoutSpec(layouts, PREFILL, sampling_rank(layouts), store,
                             async_swap=params.async_pipeline)
    pool = start_workers(config, setup, prefill, num_blocks, threads,
                         extension=SeesawWorker(layout_spec))
    device_blocks = BlockManager(num_blocks, block_size)
    scheduler = SeesawScheduler(device_blocks, BlockManager(store_blocks, block_size),
                                params.max_num_seqs, params.max_num_batched_tokens,
                                setup.max_model_len, prefill_depth=prefill.pp,
                                decode_depth=layouts[DECODE].pp, policy=params.schedule)
    executor = SeesawExecutor(pool, prefill, 0, device_blocks, config.parallel.step_timeout_seconds,
                              layouts=layouts, initial=PREFILL)
    # the CPU tier moves whole block tables between layouts: no block is released behind a window
    info = engine_info(config, setup, prefill, num_blocks, threads,
                       num_blocks * block_bytes * prefill.world_size, releases_window=False)
    info["seesaw"] = {"prefill_layout": {"tp": prefill.tp, "pp": prefill.pp},
                      "decode_layout": {"tp": layouts[DECODE].tp, "pp": layouts[DECODE].pp},
                      "cpu_store_tokens": store_blocks * block_size,
                      "cpu_store_bytes": store_blocks * block_size * token_bytes,
                      "schedule": params.schedule, "cpu_kv_tier": params.cpu_kv_tier,
                      "async_pipeline": params.async_pipeline}
    log.info("Seesaw: prefill %s, decode %s; CPU KV store %d tokens (%.2f GiB)",
             prefill.describe(), layouts[DECODE].describe(), store_blocks * block_size,
             store_blocks * block_size * token_bytes / GiB)
    return Engine([Replica(scheduler, executor)], setup.tokenizer, setup.max_model_len,
                  info["model_id"], info)
