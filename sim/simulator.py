"""The discrete-event simulator: the real Engine, schedulers and strategy preparation, on simulated
executors that advance a virtual clock by a cost model.

    result = simulate(config, requests, cost_model, arch)

`config` is the EngineConfig a recipe makes (strategy, parallel layout, KV memory); `requests`
are (prompt tokens, output tokens, predicted output tokens) triples. The engine is the one
`batchinfer run` drives: the same data-parallel feeding, the same pipeline filling, the strategy's
own Scheduler objects over real block managers sized as the engine sizes them, and the strategy's
`prepare` (e.g. a step-time table profiled on the simulated executor, in virtual time).
Nothing reads the wall clock, so a simulation is deterministic.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
from dataclasses import asdict, dataclass, field
from typing import Optional

from batchinfer.engine.build import GiB, activation_headroom, kv_element_bytes
from batchinfer.engine.build_paths import use_async_scheduling
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine, Replica
from batchinfer.engine.errors import ConfigError, RequestError
from batchinfer.engine.kv_groups import (KVGroupLayout, check_group_capacity, groups_for,
                                         make_block_manager, step_tokens)
from batchinfer.engine.kv_swap import attach_swap_space, swap_blocks_for
from batchinfer.engine.model.arch import ModelArch
from batchinfer.engine.request import Request, SamplingParams
from batchinfer.engine.runtime.build import num_kv_blocks
from batchinfer.engine.runtime.layout import ParallelLayout, threads_per_rank

from .cost_model import CostModel, cost_device
from .executor import SimulatedExecutor, VirtualClock

FILLER_PROMPT_TOKEN = 1      # simulated prompts: only their length matters


@dataclass(frozen=True)
class SimRequest:
    prompt_len: int
    output_len: int
    predicted_len: Optional[int] = None


@dataclass
class SimResult:
    strategy: str
    tp: int
    pp: int
    dp: int
    requests: int
    failed: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    output_tok_per_s: float
    total_tok_per_s: float
    kv_capacity_tokens: int
    bubble_ratio: Optional[float]               # mean over every rank's stage
    bubble_ratio_by_stage: dict = field(default_factory=dict)
    steps: int = 0
    preemptions: int = 0
    phase_switches: Optional[int] = None
    strategy_stats: dict = field(default_factory=dict)
    kv_swap: dict = field(default_factory=dict)   # memory.preemption_mode swap: its counts

    def to_json(self) -> dict:
        return asdict(self)


class LengthOnlyTokenizer:
    """What the engine asks of a tokenizer when requests carry token counts, not text: the
    simulated outputs are filler ids that stop on their length."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_ids: tuple[int, ...] = ()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def decode_reply(self, ids: list[int], skip_special_tokens: bool = True,
                     prompt_ids=()) -> str:
        """A finished reply's text (engine/output.py)."""
        return ""

    def token_text(self, token_id: int) -> str:
        return ""

    def token_bytes(self, token_id: int) -> bytes:
        return b""


def kv_blocks(config: EngineConfig, layout: ParallelLayout, arch: ModelArch, cost: CostModel,
              dtype_bytes: int, max_model_len: int,
              groups: Optional[KVGroupLayout] = None) -> int:
    """Blocks per replica: the engine's count (engine/runtime/build.py) for the cost model's
    device and memory (pages of the KV layer groups' slots where the model runs groups)."""
    blocks = num_kv_blocks(config, layout, arch, cost_device(cost), dtype_bytes,
                           cost.memory_bytes, groups=groups)
    check_pool(config, layout, max_model_len, blocks, groups)
    return blocks


def check_pool(config: EngineConfig, layout: ParallelLayout, max_model_len: int,
               num_blocks: int, groups: Optional[KVGroupLayout]) -> None:
    """The engine's start-up checks of a replica's pool: one max_model_len request fits (with
    KV layer groups: fits its largest step over every group)."""
    if groups is None:
        check_kv_capacity(num_blocks * config.cache.block_size, layout, max_model_len)
    else:
        check_group_capacity(groups, num_blocks, config.cache.block_size, max_model_len,
                             step_tokens(config, max_model_len))


def check_rank_memory(config: EngineConfig, layout: ParallelLayout, arch: ModelArch,
                      cost: CostModel, dtype_bytes: int) -> None:
    """A simulated GPU rank holds its share of the weights (per_rank_kv_budget's), one forward's
    working memory (kv_budget's activation_headroom) and an explicit memory.kv_cache_memory: a
    layout where they exceed the GPU is refused with the numbers, for every strategy (SiDP's
    replicas too: its freed FFN bytes come on top of plain DP's per-rank budget, as its build
    sizes them). Without it an explicit KV simulated 145 GB of weights on a 24 GB card, and an
    automatic one said "leaves 0 KV tokens". As the engine measures a card: an explicit KV
    against its whole memory (gpu_memory.kv_budget_on_gpu), an automatic one against its
    memory_utilization share; a measured table's memory is what its run had for weights and KV,
    which the weights alone must fit. CPU ranks share the host's memory: the run's own
    check_weights_fit refuses there."""
    if cost_device(cost).type != "cuda":
        return
    weights = arch.num_params() * dtype_bytes // layout.ranks_per_replica
    asked = config.cache.kv_cache_memory
    memory = cost.memory_bytes
    where = f"parallel: tp={layout.tp} pp={layout.pp} dp={layout.dp}: the weights"
    if not getattr(cost, "memory_is_card", True):
        # a measured table's memory is the room its run had for weights + KV (the card less its
        # working memory, at its memory_utilization): the weights alone must fit it; a KV asked
        # past it may still fit the card, as the engine decides
        if weights > memory:
            raise ConfigError(f"{where} ({weights / GiB:.1f} GiB a rank) do not fit the "
                              f"{memory / GiB:.1f} GiB the measured GPU had for weights and KV")
        return
    headroom = activation_headroom(arch, config.scheduler.max_num_batched_tokens,
                                   config.scheduler.max_num_seqs, dtype_bytes)
    room = memory if asked is not None else int(memory * config.cache.memory_utilization)
    if weights + headroom + (int(asked) if asked is not None else 0) <= room:
        return
    kv = f" + memory.kv_cache_memory {int(asked) / GiB:.2f} GiB" if asked is not None else ""
    card = (f"{memory / GiB:.1f} GiB" if asked is not None else
            f"{memory / GiB:.1f} GiB x memory.memory_utilization "
            f"{config.cache.memory_utilization} = {room / GiB:.1f} GiB")
    raise ConfigError(f"{where} ({weights / GiB:.1f} GiB a rank){kv} + working memory "
                      f"{headroom / GiB:.2f} GiB do not fit the GPU's {card}")


def check_kv_capacity(tokens: int, layout: ParallelLayout, max_model_len: int) -> None:
    if tokens < max_model_len:
        raise ConfigError(f"parallel: tp={layout.tp} pp={layout.pp} dp={layout.dp} leaves "
                          f"{max(tokens, 0)} KV tokens per replica, less than "
                          f"max_model_len ({max_model_len})")


@dataclass
class SimSetup:
    """What a strategy's simulator model gets (StrategyParams.simulated_replicas): the engine
    config, the model, the cost model, the shared virtual clock, the layout, `info` for what
    the simulated engine should report, and the KV layer groups the standard engine runs with
    on this layout (groups_for by its stages; None: one table)."""

    config: EngineConfig
    arch: ModelArch
    cost: CostModel
    clock: VirtualClock
    layout: ParallelLayout
    dtype_bytes: int
    max_model_len: int
    threads: int
    info: dict
    kv_groups: Optional[KVGroupLayout] = None

    def plain_kv_blocks(self) -> int:
        """Blocks per replica the standard engine would have (no capacity check)."""
        return num_kv_blocks(self.config, self.layout, self.arch, cost_device(self.cost),
                             self.dtype_bytes, self.cost.memory_bytes, groups=self.kv_groups)


def check_simulated(config: EngineConfig) -> None:
    """A strategy that builds its own engine needs a simulator model of its own (its replicas,
    or the options of the standard simulated executor); an external engine has none."""
    strategy = config.strategy
    if strategy is not None and not is_simulated(type(strategy)):
        from batchinfer.strategies import STRATEGIES

        known = ", ".join(name for name, cls in STRATEGIES.items() if is_simulated(cls))
        raise ConfigError(f"strategy {strategy.name!r} is not simulated; simulated: {known}")


def is_simulated(cls) -> bool:
    from batchinfer.strategies.base import StrategyParams

    def overrides(name: str) -> bool:
        return getattr(cls, name) is not getattr(StrategyParams, name)

    own_engine = overrides("build_engine")
    return cls.simulated and (not own_engine or overrides("simulated_replicas")
                              or overrides("simulated_executor_options"))


def simulated_engine(config: EngineConfig, cost: CostModel, arch: ModelArch, max_model_len: int,
                     dtype_bytes: int, cores: int = 1, model_id: str = "simulated") -> Engine:
    """An Engine whose replicas run on simulated executors (one virtual clock for all): the
    strategy's own simulator model where it has one, else the standard simulated pipeline."""
    check_simulated(config)
    layout = ParallelLayout.resolve(config.parallel, arch)
    check_rank_memory(config, layout, arch, cost, dtype_bytes)
    threads = threads_per_rank(config.parallel, layout.world_size, cores)
    clock = VirtualClock()
    info: dict = {}
    # windowed layers beside global ones: a table per KV layer group, as the engine runs them
    groups = groups_for(config, arch, max_model_len, layout.stage_ranges())
    setup = SimSetup(config, arch, cost, clock, layout, dtype_bytes, max_model_len, threads, info,
                     groups)
    strategy = config.strategy
    replicas = strategy.simulated_replicas(setup) if strategy is not None else None
    if replicas is None:
        num_blocks = kv_blocks(config, layout, arch, cost, dtype_bytes, max_model_len, groups)
        # what the real engine's plain workers do (runtime/build.worker_extension); a strategy's
        # own options (SiPipe's) come on top
        options = {"structure_aware": config.parallel.stage_transport == "structured",
                   "token_safe": strategy is not None and strategy.prepares_inputs_ahead(),
                   "launch_ahead": use_async_scheduling(config, cost_device(cost), arch)}
        if strategy is not None:
            options.update(strategy.simulated_executor_options(layout))
        if config.parallel.stage_transport == "metadata":
            options["structure_aware"] = False
        replicas = []
        # memory.preemption_mode swap: a block's K/V over every layer, as the engine sizes the
        # swap area (kv_element_bytes: the cache's element, cache.kv_cache_dtype resolved)
        block_bytes = arch.kv_bytes_per_token(kv_element_bytes(config, dtype_bytes)) * \
            config.cache.block_size
        for index in range(layout.dp):
            # blocks behind a sliding window released, as the engine does (prefix caching is not
            # simulated)
            block_manager = make_block_manager(groups, num_blocks, config.cache.block_size,
                                               False, config.cache.kv_window(arch))
            scheduler = config.make_scheduler(block_manager, max_model_len, layout.pp)
            attach_swap_space(block_manager, scheduler, swap_blocks_for(config.cache, block_bytes))
            executor = SimulatedExecutor(clock, cost, list(layout.layers_per_stage), layout.tp,
                                         threads, index, swap=block_manager.swap,
                                         swap_block_bytes=block_bytes, **options)
            replicas.append(Replica(scheduler, executor))
    info.update({"vocab_size": arch.vocab_size, "simulated": True,
            "parallel": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
                         "layers_per_stage": list(layout.layers_per_stage),
                         "threads_per_rank": threads}})
    engine = Engine(replicas, LengthOnlyTokenizer(arch.vocab_size), max_model_len, model_id,
                    info, clock=clock)
    if config.strategy is not None:
        engine.info["strategy"] = config.strategy.name
        with _quiet("batchinfer"):      # its startup log speaks of wall time; this is virtual
            config.strategy.prepare(engine)
    return engine


@contextlib.contextmanager
def _quiet(name: str):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


SAMPLER_KNOBS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "frequency_penalty", "presence_penalty")


def sampling_knobs(params: SamplingParams) -> dict:
    """The fields of `params` a cost model prices the sampler by (a recipe's sampling)."""
    return {name: getattr(params, name) for name in SAMPLER_KNOBS}


def simulate(config: EngineConfig, requests: list[SimRequest], cost: CostModel, arch: ModelArch,
             max_model_len: int, dtype_bytes: int, cores: int = 1,
             sampling: Optional[dict] = None) -> SimResult:
    """Runs every request to its output length (all submitted at time 0, as `batchinfer run` and
    `vllm bench throughput` do) and reports the virtual throughput. `sampling`: SamplingParams
    fields every request samples with (greedy when not given); cost models that price the
    sampler by its knobs read them."""
    knobs = ({k: v for k, v in sampling.items() if k not in ("max_tokens", "ignore_eos")}
             if sampling is not None else {"temperature": 0.0})
    engine = simulated_engine(config, cost, arch, max_model_len, dtype_bytes, cores)
    failed = 0
    start = engine.now()
    for i, req in enumerate(requests):
        request = Request(f"sim-{i}", [FILLER_PROMPT_TOKEN] * req.prompt_len,
                          SamplingParams(max_tokens=max(req.output_len, 1), ignore_eos=True,
                                         **knobs), arrival_index=i)
        request.predicted_output_len = req.predicted_len
        try:
            engine.add_request(request)
        except RequestError:
            failed += 1
    prompt_tokens = output_tokens = finished = 0
    while engine.has_unfinished():
        for out in engine.step():
            finished += 1
            prompt_tokens += len(out.prompt_token_ids)
            output_tokens += out.num_output_tokens       # n samples: all of them
        engine.drain_step_events()
    elapsed = max(engine.now() - start, 1e-12)
    stats = engine.stats()
    return _result(config, engine, stats, finished, failed, prompt_tokens, output_tokens, elapsed)


def _result(config: EngineConfig, engine: Engine, stats: dict, finished: int, failed: int,
            prompt_tokens: int, output_tokens: int, elapsed: float) -> SimResult:
    par = engine.info["parallel"]
    bubbles: dict[str, list[float]] = {}
    for rep in engine.replicas:
        summary = rep.executor.stage_summary()
        for stage in (summary or {}).get("stages", []):
            if stage["bubble_ratio"] is not None:
                bubbles.setdefault(str(stage["stage"]), []).append(stage["bubble_ratio"])
    by_stage = {s: round(statistics.mean(v), 4) for s, v in sorted(bubbles.items())}
    return SimResult(
        strategy=config.strategy.name if config.strategy is not None else "baseline",
        tp=par["tp"], pp=par["pp"], dp=par["dp"], requests=finished, failed=failed,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens, elapsed_s=elapsed,
        output_tok_per_s=output_tokens / elapsed,
        total_tok_per_s=(prompt_tokens + output_tokens) / elapsed,
        kv_capacity_tokens=stats["kv_capacity_tokens"],
        bubble_ratio=round(statistics.mean(by_stage.values()), 4) if by_stage else None,
        bubble_ratio_by_stage=by_stage, steps=stats["steps"],
        preemptions=stats["num_preemptions"],
        phase_switches=getattr(engine.scheduler, "num_switches", None),
        strategy_stats=stats.get("strategy_stats", {}), kv_swap=stats.get("kv_swap", {}))


def simulate_recipe_model(config: EngineConfig, requests: list[SimRequest], cost: CostModel,
                          cores: int) -> SimResult:
    """`simulate` for the model the config names (its config.json, overrides and length limit),
    on a cost model of this machine."""
    from batchinfer.engine.runtime.build import model_setup

    setup = model_setup(config)
    return simulate(config, requests, cost, setup.arch, setup.max_model_len, setup.dtype_bytes,
                    cores)
