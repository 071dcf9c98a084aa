"""Strategy `sipipe`: SiPipe's three mechanisms on the multi-process pipeline
(arXiv:2506.22033 §5), each switchable off as in the paper's ablation (§7.5):

- `cpu_sampling`: sampling leaves the last stage for a pool of CPU sampler processes with
  column-wise, incrementally updated state (strategies/sipipe/column_sampler.py); off: the last
  stage samples, as in the baseline. `split_columns` spreads every micro-batch's columns over the
  whole pool (`samplers` processes of `sampler_threads` threads; sampler_pool.py); off: one
  sampler per micro-batch, micro-batch n on sampler n mod p;
- `token_safe_execution`: every worker prepares its inputs one iteration ahead on its own thread
  into two versioned buffers (engine/runtime/input_prep.py); off: inline before each forward;
- `structure_aware_transmission`: after the first transfer between two stages the receiver knows
  the activations' structure and posts its receives as soon as the plan arrives, and no metadata
  travels (engine/runtime/stage_transport.py); off: per-transfer metadata, blocking, as vLLM's
  send_tensor_dict.
Batching is the baseline's (policy, max_num_seqs, ...); the pipeline keeps p micro-batches in
flight and micro-batch n + p is scheduled once n's tokens are back (§4.2).
"""
from __future__ import annotations

from typing import ClassVar, Literal, Union

from pydantic import Field, field_validator, model_validator

from batchinfer.engine.config import SchedulerConfig
from batchinfer.strategies.base import StrategyParams, register_strategy


class SiPipeParams(StrategyParams, SchedulerConfig):
    """SiPipe's switches, plus the baseline's batching knobs."""

    name: Literal["sipipe"] = "sipipe"
    kv_layer_groups: ClassVar[bool] = True
    cpu_sampling: bool = Field(True, description="sample in a pool of CPU sampler processes "
                               "with column-wise incremental state (§5.1); off: on the last stage")
    samplers: Union[int, Literal["auto"]] = Field(
        "auto", description="CPU sampler processes per replica (the pool); auto: p "
        "(parallel.pp), one per micro-batch in flight")
    split_columns: bool = Field(True, description="every micro-batch's sampled rows split across "
                                "the whole pool, each sampler holding p column replicas of its "
                                "share (§4, §6); false: micro-batch n wholly on sampler n mod p")
    token_safe_execution: bool = Field(True, description="prepare inputs one iteration ahead on "
                                       "a thread, into two versioned buffers (§5.2)")
    structure_aware_transmission: bool = Field(True, description="metadata-free, pre-posted "
                                               "receives between stages after the first (§5.3)")
    sampler_threads: int = Field(1, ge=1, description="torch threads of each sampler process")

    @field_validator("samplers", mode="before")
    @classmethod
    def _pool_size(cls, value):
        if value == "auto" or (type(value) is int and value >= 1):
            return value
        raise ValueError("a whole number of sampler processes >= 1, or auto")

    @model_validator(mode="after")
    def _pool_without_split(self):
        if not self.split_columns and self.samplers != "auto":
            raise ValueError(f"samplers: {self.samplers} needs split_columns: true; without the "
                             "split the pool is one sampler per micro-batch in flight (p = "
                             "parallel.pp), so leave samplers at auto")
        return self

    def idle_switches(self) -> list[tuple[str, str]]:
        return self.idle_unless(
            self.cpu_sampling, "strategy.cpu_sampling is false (the last stage samples; no "
            "sampler pool)", "samplers", "split_columns", "sampler_threads")

    def pool_size(self, pipeline_depth: int) -> int:
        return pipeline_depth if self.samplers == "auto" else self.samplers

    def sampler_pool(self, pipeline_depth: int):
        from .sampler_pool import PoolLayout

        return PoolLayout.of(pipeline_depth, self.max_num_seqs, self.split_columns,
                             self.pool_size(pipeline_depth))

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(**self.model_dump(include=set(SchedulerConfig.model_fields)))

    def build_engine(self, config):
        from .build import build_sipipe_engine

        return build_sipipe_engine(config, self)


    @classmethod
    def applies_to(cls, tp: int, pp: int, dp: int) -> bool:
        return pp >= 2          # a pipeline mechanism: nothing to do without stages

    def simulated_executor_options(self, layout) -> dict:
        """The pool's CPU samplers of sampler_threads cores each (split: every micro-batch's rows
        across all of them; else micro-batch n on sampler n mod p), structure-aware hand-offs
        and token-safe input preparation (priced where the cost model separates input
        preparation from the forward: the GPU presets; a measured CPU profile has it inside the
        forward)."""
        return {"cpu_samplers": self.pool_size(layout.pp) if self.cpu_sampling else 0,
                "sampler_threads": self.sampler_threads,
                "split_samples": self.split_columns,
                "structure_aware": self.structure_aware_transmission,
                "token_safe": self.token_safe_execution}


register_strategy("sipipe", SiPipeParams)
