"""Strategy `sidp`: data-parallel replicas that share FFN weights (arXiv:2605.28095 §4).

Ownership (layer l -> rank l mod d, or `owners`); Weight as a Service with d - 1 preallocated
weight slots per rank filled ahead of use by a prefetch / housekeeper thread, and peak shifting
(`peak_shifting: false` is the paper's ablation, Fig. 10), where a remote read is slower than a
local one (`weight_slots` unset: CUDA, or CPUs over several NUMA nodes; on one memory the
replicas compute from the owner's rows in place); the freed FFN memory becomes KV cache
at plain DP's per-replica memory budget. Compute as a Service for the small-batch tail (activations
to the owner, GEMM fusion, dummy skipping), entered and left by the job orchestrator at the batch
threshold B_th (profiled at startup unless given) with patience and hysteresis
(`compute_service: false` is the paper's WaS-only, Fig. 13). Device cpu: the store is host shared
memory; cuda: the replicas share one GPU (`parallel.gpu_transport: host`) and map the store in its
memory through CUDA IPC (owner buffers over several GPUs are not built).
"""
from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field

from batchinfer.engine.config import SchedulerConfig
from batchinfer.strategies.base import StrategyParams, batching, register_strategy


class SiDPParams(StrategyParams, SchedulerConfig):
    """SiDP's knobs, plus the baseline's batching knobs (per replica)."""

    name: Literal["sidp"] = "sidp"
    kv_layer_groups: ClassVar[bool] = True
    owners: Optional[list[int]] = Field(None, description="owner rank of each layer's FFN "
                                        "weights; default: layer l -> rank l mod dp")
    peak_shifting: bool = Field(True, description="rank r starts each dp-layer cycle's "
                                "prefetches at layer c + r (§4.2); off: every rank at c")
    weight_slots: Optional[bool] = Field(None, description="read remote FFN weights into "
                                         "d - 1 slots ahead of use (§4.2); false: compute from "
                                         "the owner's shared rows in place, no copies; default: "
                                         "slots where a remote read is slower than a local one "
                                         "(CPUs over several NUMA nodes), in place on one "
                                         "memory (one CPU memory, or the one GPU the replicas "
                                         "share)")
    compute_service: bool = Field(True, description="CaS (§4.3): below B_th the replicas run "
                                  "in rounds and send FFN inputs to each layer's owner; false: "
                                  "WaS only")
    batch_threshold: Optional[int] = Field(None, ge=1, description="B_th: CaS once the "
                                           "effective batch (the tokens the group runs in "
                                           "an iteration, all replicas) stays below it; default: profiled at "
                                           "startup (strategies/sidp/cost_profile.py)")
    mode_switch_patience: int = Field(16, ge=1, description="iterations the batch must stay "
                                      "past a bound before the group switches mode")
    mode_switch_hysteresis: float = Field(1.5, ge=1.0, description="back to WaS only once the "
                                          "batch stays at or above this x B_th")
    gemm_fusion: bool = Field(True, description="the owner runs one GEMM over every "
                              "replica's rows (§4.3); false: one per replica")
    dummy_skipping: bool = Field(True, description="a replica with no work brings nothing to a "
                                 "CaS round (§4.3); false: it pushes one zero row through "
                                 "every layer, as a dummy run would")

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(**self.model_dump(include=set(SchedulerConfig.model_fields)))

    def build_engine(self, config):
        from .build import build_sidp_engine

        return build_sidp_engine(config, self)

    def lora_refusal(self, model_cfg, arch):
        from .build import mlp_adapter_refusal

        return mlp_adapter_refusal(model_cfg, arch)

    def check_config(self, config, arch) -> None:
        from batchinfer.engine.build import resolve_device
        from batchinfer.engine.errors import ConfigError

        from .build import check_one_gpu, check_sidp_layout, check_sidp_model
        from .ownership import resolve_owners

        check_sidp_layout(config.parallel)
        check_sidp_model(config, self, arch)
        try:
            resolve_owners(self.owners, arch.num_layers, config.parallel.dp)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if resolve_device(config.device.device).type == "cuda":
            check_one_gpu(config, config.parallel.dp)

    @classmethod
    def applies_to(cls, tp: int, pp: int, dp: int) -> bool:
        return tp == 1 and pp == 1 and dp >= 2      # replicas that share one FFN store

    def layout_note(self, parallel) -> Optional[str]:
        """`peak_shifting: false` where it cannot change a read (the ablation would run as
        the default): it orders the weight slots' reads of a dp-layer cycle."""
        if self.peak_shifting or parallel.dp < 2:
            return None
        if parallel.dp == 2 and self.owners is None:
            return ("strategy.peak_shifting: false changes nothing at parallel.dp 2: a replica "
                    "reads one remote layer per 2-layer cycle, so there is no order to shift "
                    "(it matters from dp 3, with weight slots)")
        if self.weight_slots is not True:
            how = ("false" if self.weight_slots is False else "unset (in place on one memory: "
                   "one CPU memory, or the one GPU; slots only over several NUMA nodes)")
            return (f"strategy.peak_shifting: false orders the weight slots' reads; with "
                    f"weight_slots {how} the replicas compute from the owner's rows and read "
                    "nothing ahead, so it changes nothing there: set weight_slots: true for "
                    "the paper's ablation")
        return None

    def idle_switches(self) -> list[tuple[str, str]]:
        return self.idle_unless(
            self.compute_service, "strategy.compute_service is false (WaS only: no Compute as a "
            "Service rounds)", "batch_threshold", "mode_switch_patience",
            "mode_switch_hysteresis", "gemm_fusion", "dummy_skipping")

    @classmethod
    def runs_model(cls, arch) -> bool:
        # the store holds one dense SiLU-gated FFN per layer
        return arch.moe is None and arch.hidden_act == "silu"

    @classmethod
    def search_params(cls, knobs: SchedulerConfig) -> list[tuple[str, dict]]:
        return [("sidp", {"name": "sidp", "policy": "hb", **batching(knobs)})]

    def simulated_replicas(self, sim) -> list:
        from .sim import sidp_replicas

        replicas, sim.info["sidp"] = sidp_replicas(
            sim.config, self, sim.arch, sim.cost, sim.clock, sim.layout, sim.dtype_bytes,
            sim.max_model_len, sim.threads, sim.plain_kv_blocks(), sim.kv_groups)
        return replicas


register_strategy("sidp", SiDPParams)
