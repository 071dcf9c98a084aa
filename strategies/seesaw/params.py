"""Strategy `seesaw`: dynamic re-sharding between a prefill layout and a decode layout, with a CPU
KV tier (arXiv:2503.06433).

The recipe's `parallel` section is the prefill layout c_p (e.g. pp: 2); `decode_tp` x
`decode_pp` is the decode layout c_d over the same ranks (e.g. TP=2). As the paper does, the
layouts can be left to the model of the hardware: `decode_tp` / `decode_pp: auto` (the default)
and `prefill_layout: auto` are resolved when a run starts by simulating every alternative on the
job's own prompts (strategies/seesaw/auto_layout.py). Prefill runs in c_p and
writes each prompt's KV into a CPU store in shared memory; decode runs in c_d and pulls the
sequences back in through a per-worker prefetcher; the layouts switch only when the store is full
or empty (strategies/seesaw/scheduler.py). The machinery is in resharding/.

Ablations: `schedule` prefill_prioritizing / decode_prioritizing (the paper's Fig. 2 policies),
`cpu_kv_tier: false` (the store only stages the re-sharding: it holds what the device cache holds,
so prefill stops when the device would be full), `async_pipeline: false` (copies run on the
workers' main thread, between micro-batches, instead of the prefetcher thread).
"""
from __future__ import annotations

from typing import ClassVar, Literal, Optional, Union

from pydantic import Field, PositiveInt, field_validator

from batchinfer.engine.config import SchedulerConfig, parse_size
from batchinfer.strategies.base import AutoSearch, StrategyParams, register_strategy
from .auto_layout import AUTO


class SeesawParams(StrategyParams):
    """Seesaw's knobs: the decode layout, the CPU store, the schedule and the ablation switches."""

    name: Literal["seesaw"] = "seesaw"
    kv_layer_groups: ClassVar[bool] = True
    swaps_preempted: ClassVar[bool] = False     # its own CPU KV tier, not the swap area
    applies_lora: ClassVar[bool] = False        # its re-sharded partitions carry no adapters
    decode_tp: Union[Literal["auto"], PositiveInt] = Field(
        AUTO, description="tensor-parallel degree of the decode layout c_d; auto: the one the "
        "simulator predicts fastest on the job's prompts (with decode_pp given, the ranks fix it)")
    decode_pp: Union[Literal["auto"], PositiveInt] = Field(
        AUTO, description="pipeline depth of the decode layout c_d; auto: as decode_tp")
    prefill_layout: Literal["parallel", "auto"] = Field(
        "parallel", description="the prefill layout c_p: the recipe's parallel section as given, "
        "or auto: the simulator picks its tp x pp over the same ranks, with c_d")
    layout_costs: str = Field(
        "measured", description="what prices the alternatives of an auto layout: measured (this "
        "machine's profile of the model, made once and kept in the setup cache), a profile table "
        "(profile_table.json from `batchinfer profile`) or a hardware preset (a10, l4, l20, "
        "a100-pcie, a100-sxm, h100, h20, h200)")
    layout_sample_requests: int = Field(256, ge=1, description="an auto layout is chosen by "
                                        "simulating the first N usable requests of the input")
    decode_pp_layers: Optional[list[int]] = Field(
        None, description="layers per decode pipeline stage; default: parallel.pp_balance's split")
    cpu_kv_cache_memory: Union[int, str] = Field(
        "4GiB", validate_default=True, description="size of the CPU KV store (shared memory), "
        "whole-model KV for all heads and layers")
    schedule: Literal["transition_minimizing", "prefill_prioritizing", "decode_prioritizing"] = \
        Field("transition_minimizing", description="when to switch layouts (paper §4.2 / Fig. 2)")
    cpu_kv_tier: bool = Field(True, description="off: the store holds only what the device cache "
                              "holds (it stages the re-sharding), so prefill runs to device capacity")
    async_pipeline: bool = Field(True, description="off: KV copies run on the workers' main "
                                 "thread between micro-batches, not in the prefetcher thread")
    max_num_seqs: int = Field(1024, ge=1, description="most sequences decoding at once")
    max_num_batched_tokens: int = Field(2048, ge=16, description="prompt tokens per prefill "
                                        "micro-batch (a longer prompt goes alone)")

    @field_validator("cpu_kv_cache_memory")
    @classmethod
    def _size(cls, v):
        return parse_size(v)

    def idle_switches(self) -> list[tuple[str, str]]:
        return [
            *self.idle_unless(self.cpu_kv_tier, "strategy.cpu_kv_tier is false (the store holds "
                              "as many blocks as the device cache)", "cpu_kv_cache_memory"),
            *self.idle_unless(AUTO in (self.decode_tp, self.decode_pp, self.prefill_layout),
                              "no layout is auto (decode_tp and decode_pp are given, "
                              "prefill_layout is parallel), so none is searched",
                              "layout_costs", "layout_sample_requests")]

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(policy="sb", max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens)

    def make_scheduler(self, block_manager, max_model_len: int, pipeline_depth: int):
        raise NotImplementedError("seesaw builds its scheduler with its CPU store "
                                  "(strategies/seesaw/build.py)")

    def build_engine(self, config):
        from .build import build_seesaw_engine

        return build_seesaw_engine(config, self)

    def check_config(self, config, arch) -> None:
        from .auto_layout import check_one_replica
        from .build import check_no_prefix_caching, resolve_layouts

        check_no_prefix_caching(config)
        check_one_replica(config.parallel)
        if self.auto_keys():                 # the costs the auto layout is simulated with
            from batchinfer.sim.auto_settings import check_costs_name

            check_costs_name(self.layout_costs, "strategy.layout_costs")
        self._each_layout(config, arch, lambda cfg: resolve_layouts(cfg, cfg.strategy, arch))

    def check_kv_budget(self, config, arch, max_model_len: int, kv_bytes: int) -> bool:
        """The device cache and the CPU store as the build sizes them (build.tier_blocks)."""
        from .build import resolve_layouts, seesaw_groups, tier_blocks

        def check(cfg) -> None:
            layouts = resolve_layouts(cfg, cfg.strategy, arch)
            tier_blocks(cfg, cfg.strategy, arch, layouts, int(cfg.cache.kv_cache_memory),
                        kv_bytes, max_model_len, seesaw_groups(cfg, arch, layouts, max_model_len))

        self._each_layout(config, arch, check)
        return True

    def _each_layout(self, config, arch, check) -> None:
        """`check` on the recipe's layouts; with layouts left to auto, a ConfigError only where
        it refuses every alternative the simulation would choose between."""
        if not self.auto_keys():
            check(config)
            return
        from batchinfer.sim.auto_settings import check_some_alternative_runs

        check_some_alternative_runs(config, arch, check)

    def auto_keys(self) -> list[str]:
        keys = [k for k in ("decode_tp", "decode_pp") if getattr(self, k) == AUTO]
        if len(keys) == 1:     # the other one and the ranks fix it (build.resolve_layouts)
            keys = []
        return keys + (["prefill_layout"] if self.prefill_layout == AUTO else [])

    def auto_search(self, parallel, arch) -> AutoSearch:
        from .auto_layout import layout_search

        return layout_search(self, parallel, arch)

    def simulated_replicas(self, sim) -> list:
        from .sim import seesaw_replica

        return [seesaw_replica(sim.config, self, sim.arch, sim.cost, sim.clock, sim.dtype_bytes,
                               sim.max_model_len, sim.threads)]


register_strategy("seesaw", SeesawParams)
