"""Strategy `sipipe`: SiPipe's three mechanisms on the multi-process pipeline
(arXiv:2506.22033 §5), each switchable off as in the paper's ablation (§7.5):

- `cpu_sampling`: sampling leaves the last stage for p CPU sampler processes with column-wise,
  incrementally updated state (strategies/sipipe/column_sampler.py); off: the last stage samples, as in the
  baseline;
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

from typing import Literal

from pydantic import Field

from batchinfer.engine.config import SchedulerConfig
from batchinfer.strategies.base import StrategyParams, register_strategy


class SiPipeParams(StrategyParams, SchedulerConfig):
    """SiPipe's switches, plus the baseline's batching knobs."""

    name: Literal["sipipe"] = "sipipe"
    cpu_sampling: bool = Field(True, description="sample in p CPU sampler processes with "
                               "column-wise incremental state (§5.1); off: on the last stage")
    token_safe_execution: bool = Field(True, description="prepare inputs one iteration ahead on "
                                       "a thread, into two versioned buffers (§5.2)")
    structure_aware_transmission: bool = Field(True, description="metadata-free, pre-posted "
                                               "receives between stages after the first (§5.3)")
    sampler_threads: int = Field(1, ge=1, description="torch threads of each sampler process")

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(**self.model_dump(include=set(SchedulerConfig.model_fields)))

    def build_engine(self, config):
        from .build import build_sipipe_engine

        return build_sipipe_engine(config, self)


    @classmethod
    def applies_to(cls, tp: int, pp: int, dp: int) -> bool:
        return pp >= 2          # a pipeline mechanism: nothing to do without stages

    def simulated_executor_options(self, layout) -> dict:
        """p CPU samplers of sampler_threads cores each (one per pipeline stage, as build.py
        starts them), structure-aware hand-offs and token-safe input preparation (priced where
        the cost model separates input preparation from the forward: the GPU presets; a
        measured CPU profile has it inside the forward)."""
        return {"cpu_samplers": layout.pp if self.cpu_sampling else 0,
                "sampler_threads": self.sampler_threads,
                "structure_aware": self.structure_aware_transmission,
                "token_safe": self.token_safe_execution}


register_strategy("sipipe", SiPipeParams)
