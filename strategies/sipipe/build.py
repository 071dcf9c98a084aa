"""Assembles a SiPipe engine: the baseline's workers with SiPipe's worker switches, and (with CPU
sampling) a pool of sampler processes per replica (sampler_pool.py) wired to the last stage by
shared-memory logits slots and pipes."""
from __future__ import annotations

import logging
import multiprocessing as mp

from batchinfer.engine.engine import Engine
from batchinfer.engine.runtime.build import (assemble_engine, decode_graph_spec, plan_parallel,
                                             start_workers)
from batchinfer.engine.runtime.executor import PipelineExecutor
from batchinfer.engine.runtime.layout import ParallelLayout
from batchinfer.engine.structured_output import tokenizer_source

from .executor import SiPipeExecutor
from .logits_channel import SamplerLink, allocate_slots
from .sampler_pool import PoolLayout
from .sampler_process import SamplerSpec, sampler_main
from .worker import SiPipeWorker

log = logging.getLogger("batchinfer")


def _samplers(setup, layout: ParallelLayout, pool: PoolLayout, threads: int, rank_extra: dict):
    """Sampler specs for every replica, and each last-stage rank's link to its replica's pool."""
    ctx = mp.get_context("spawn")
    vocab = setup.arch.vocab_size
    helpers, names, ranks, ends = [], [], {}, []
    for replica in range(layout.dp):
        slots, consumed = allocate_slots(pool, vocab, pool.slot_columns)
        last = [r for r in layout.replica_ranks(replica) if layout.info(r).stage == layout.pp - 1]
        writers: dict[int, list] = {r: [] for r in last}
        ranks[replica] = []
        for index in range(pool.samplers):
            rank = layout.world_size + replica * pool.samplers + index
            readers = []
            for r in last:
                read_end, write_end = ctx.Pipe(duplex=False)
                readers.append(read_end)
                writers[r].append(write_end)
                ends += [read_end, write_end]
            helpers.append((sampler_main, SamplerSpec(
                rank=rank, replica=replica, index=index, pool=pool, vocab_size=vocab,
                max_model_len=setup.max_model_len,
                eos_token_ids=tuple(setup.tokenizer.eos_token_ids),
                threads=threads, slots=slots, consumed=consumed, logits_conns=readers,
                tokenizer_source=tokenizer_source(setup.tokenizer))))
            names.append(f"sampler {index} of replica {replica}")
            ranks[replica].append(rank)
        for r in last:
            rank_extra[r]["extension"].link = SamplerLink(pool, slots, consumed, writers[r])
    return helpers, tuple(names), ranks, ends


def build_sipipe_engine(config, params) -> Engine:
    plan = plan_parallel(config)
    setup, layout = plan.setup, plan.layout
    rank_extra = {r: {"extension": SiPipeWorker(params.token_safe_execution,
                                                params.structure_aware_transmission)}
                  for r in range(layout.world_size)}
    pool_layout = params.sampler_pool(layout.pp)
    helpers, names, sampler_ranks, ends = (), (), {}, []
    if params.cpu_sampling:
        helpers, names, sampler_ranks, ends = _samplers(setup, layout, pool_layout,
                                                        params.sampler_threads, rank_extra)
    graphs = decode_graph_spec(config, setup, layout, params.token_safe_execution,
                               params.scheduler_config().max_num_seqs)
    try:
        pool = start_workers(config, setup, layout, plan.num_blocks, plan.threads,
                             rank_extra=rank_extra, helpers=tuple(helpers), helper_names=names,
                             kv_groups=plan.kv_groups, decode_graphs=graphs)
    finally:
        for end in ends:          # the children hold their own copies now
            end.close()
    timeout = config.parallel.step_timeout_seconds

    def make_executor(replica: int, block_manager):
        if params.cpu_sampling:
            return SiPipeExecutor(pool, layout, replica, block_manager, timeout,
                                  sampler_ranks[replica], pool_layout, config.model.seed)
        return PipelineExecutor(pool, layout, replica, block_manager, timeout)

    samplers = pool_layout.samplers if params.cpu_sampling else 0
    # what the workers send with: parallel.stage_transport metadata holds for SiPipe's too
    structured = (params.structure_aware_transmission
                  and config.parallel.stage_transport == "structured")
    pool_only = params.cpu_sampling or None     # the sampler pool's figures: none without it
    info = {"sipipe": {"cpu_sampling": params.cpu_sampling, "samplers_per_replica": samplers,
                       "split_columns": pool_only and params.split_columns,
                       "sampler_threads": pool_only and params.sampler_threads,
                       "sampler_columns": pool_only and pool_layout.capacity,
                       "sampler_state_replicas": pool_only and pool_layout.replicas,
                       "token_safe_execution": params.token_safe_execution,
                       "decode_graphs": ("two per batch size, one per input version"
                                         if pool.infos and pool.infos[0].get("decode_graphs")
                                         else "off"),
                       "structure_aware_transmission": structured}}
    log.info("SiPipe: CPU sampling %s (%d samplers per replica, %s, %d threads each), "
             "token-safe execution %s, structure-aware transmission %s",
             "on" if params.cpu_sampling else "off", samplers,
             "each micro-batch's columns split across them" if params.split_columns
             else "one per micro-batch", params.sampler_threads,
             "on" if params.token_safe_execution else "off",
             "on" if structured else "off")
    engine = assemble_engine(config, plan, make_executor, extra_info=info,
                             scheduler_of=lambda block_manager: params.make_scheduler(
                                 block_manager, setup.max_model_len, layout.pp))
    engine.info["parallel"]["stage_transport"] = "structured" if structured else "metadata"
    return engine
