"""Strategy `sidp`: data-parallel replicas that share FFN weights (../shared/papers/sidp.txt §4).

Built so far: ownership (layer l -> rank l mod d, or `owners`), Weight as a Service with d - 1
preallocated weight slots per rank filled ahead of use by a prefetch / housekeeper thread, and
peak shifting (`peak_shifting: false` is the paper's ablation, Fig. 10); the freed FFN memory
becomes KV cache at plain DP's per-replica memory budget (sidp/). Device cpu: the store is host
shared memory. Not yet: Compute as a Service for the small-batch tail, the WaS/CaS mode switch
and the CUDA IPC path.
"""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from batchinfer.engine.config import SchedulerConfig
from batchinfer.engine.recipe import StrategyParams, register_strategy


class SiDPParams(StrategyParams, SchedulerConfig):
    """SiDP's knobs, plus the baseline's batching knobs (per replica)."""

    name: Literal["sidp"] = "sidp"
    owners: Optional[list[int]] = Field(None, description="owner rank of each layer's FFN "
                                        "weights; default: layer l -> rank l mod dp")
    peak_shifting: bool = Field(True, description="rank r starts each dp-layer cycle's "
                                "prefetches at layer c + r (§4.2); off: every rank at c")
    weight_slots: bool = Field(True, description="read remote FFN weights into d - 1 slots "
                               "ahead of use (§4.2); false: compute from the owner's shared "
                               "rows in place, no copies (replicas share host memory)")

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(**self.model_dump(include=set(SchedulerConfig.model_fields)))

    def build_engine(self, config):
        from batchinfer.sidp.build import build_sidp_engine

        return build_sidp_engine(config, self)


register_strategy("sidp", SiDPParams)
