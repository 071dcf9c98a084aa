"""TD-Pipe's parameters (the recipe's `strategy:` section): each approach with its switch for
the paper's ablations, and the step-time table the intensity comparison reads."""
from __future__ import annotations

from typing import ClassVar, Literal, Optional, Union

from pydantic import Field, PositiveInt, model_validator

from batchinfer.engine.config import SchedulerConfig
from batchinfer.engine.kv_cache import BlockManager
from batchinfer.engine.step_times import StepTimes, profile_step_times
from batchinfer.strategies.base import StrategyParams, batching, register_strategy

class TDPipeParams(StrategyParams):
    """TD-Pipe's parameters; each approach has a switch for the paper's ablations."""

    name: Literal["tdpipe"] = "tdpipe"
    kv_layer_groups: ClassVar[bool] = True
    max_num_seqs: int = Field(1024, ge=1, description="most requests holding KV at once")
    max_num_batched_tokens: int = Field(2048, ge=16, description="prompt tokens per prefill "
                                        "micro-batch (a longer prompt goes alone)")
    # Approach 1: AI-based greedy prefill (prefill -> decode)
    greedy_prefill: bool = Field(True, description="switch to decode when the predicted KV peak "
                                 "exceeds the capacity; off: at kv_occupancy_ratio")
    future_point_interval: int = Field(32, ge=1, description="decode steps between future points")
    future_point_horizon: int = Field(1024, ge=1, description="last future point")
    kv_safety_ratio: float = Field(1.0, gt=0, le=2, description="share of the KV capacity the "
                                   "predicted peak may reach")
    count_ending_requests: bool = Field(True, description="a request also counts, at the first "
                                        "future point after its predicted end, the KV it holds "
                                        "when it ends, so replies shorter than a point interval "
                                        "are seen; off: Algorithm 1 literally (only the points "
                                        "a request outlives)")
    unsure_upper_forecast: bool = Field(False, description="Algorithm 1's getPredictLen takes "
                                        "the request's upper forecast (predictor."
                                        "upper_percentile of its length distribution) when the "
                                        "predictor is unsure of it (its class probability below "
                                        "unsure_confidence); false: always the point (the paper; "
                                        "the default: replayed on four EOS jobs the upper "
                                        "forecast cost 3.5-4.5% at caps of 512 and 1,024; timed, "
                                        "within the host's spread; performance.md)")
    unsure_confidence: float = Field(0.5, ge=0, le=1, description="a forecast whose class "
                                     "probability is below this is unsure (the paper's "
                                     "predictors are right about half the time: 52-58%)")
    overdue_doubling: bool = Field(True, description="a request that has outlived its forecast "
                                   "is expected to run as long again as it has so far (at least "
                                   "one future-point interval, at most its cap); false: one "
                                   "more future-point interval at a time")
    admit_within_capacity: Union[bool, Literal["auto"]] = Field(
        "auto", description="true: a prompt whose forecast would push the predicted peak over "
        "the capacity is not admitted while other requests run, and the phase switches to "
        "decode before it; false: Algorithm 1 as written, which checks after launching a batch, "
        "so the batch that crosses the capacity runs whole (a bet that the forecasts are long "
        "enough to leave room for it) and its excess is preempted (recomputed) in the decode "
        "phase when they are not; auto: as written until the job first preempts a request, "
        "then true")
    kv_occupancy_ratio: float = Field(0.5, gt=0, le=1, description="ablation of greedy_prefill: "
                                      "switch once this share of the KV blocks is in use")
    # Approach 2: inter-batch work stealing (decode)
    work_stealing: bool = True
    # Approach 3: spatial-temporal intensity comparison (decode -> prefill)
    intensity_switch: bool = Field(True, description="switch to prefill when spatial < temporal "
                                   "intensity; off: at finished_ratio")
    finished_ratio: float = Field(0.5, gt=0, le=1, description="ablation of intensity_switch: "
                                  "switch once this share of the decode phase's requests is done")
    # the centralized engine (§3.2.1): prefills are sent on without waiting for results
    launch_prefills_ahead: bool = Field(True, description="in a prefill phase keep up to 2 x PP "
                                        "micro-batches in flight (the prefills do not depend on "
                                        "each other, so a stage never waits on the controller for "
                                        "its next one); off: PP, as in decode")
    # the step-time table the intensities read
    step_times: Optional[str] = Field(None, description="JSON step-time table to load instead of "
                                      "profiling at startup (report.json's engine.step_times)")
    profile_decode_batch_sizes: list[PositiveInt] = Field(
        default_factory=lambda: [1, 8, 32, 64, 128, 256], min_length=1)
    profile_prefill_tokens: list[PositiveInt] = Field(default_factory=lambda: [256, 1024],
                                                      min_length=1)
    profile_context_len: int = Field(128, ge=1, description="KV tokens per profiled decode")

    @model_validator(mode="after")
    def _points(self):
        if self.future_point_horizon < self.future_point_interval:
            raise ValueError("future_point_horizon must be at least future_point_interval")
        return self

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(policy="sb", max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens)

    def reads_length_forecasts(self) -> bool:
        return self.greedy_prefill     # Approach 1 is the one that reads the predictor

    def check_config(self, config, arch) -> None:
        """A step-time table to load that is not one (prepare would refuse it after the
        model loads)."""
        if self.step_times:
            from batchinfer.engine.errors import ConfigError

            try:
                StepTimes.load(self.step_times)
            except ConfigError as exc:
                raise ConfigError(f"strategy.step_times: {exc}") from None

    def make_scheduler(self, block_manager: BlockManager, max_model_len: int,
                       pipeline_depth: int):
        from .scheduler import TDPipeScheduler

        return TDPipeScheduler(block_manager, self, max_model_len, pipeline_depth)

    def prepare(self, engine) -> None:
        """Gives every replica's scheduler the step-time table (loaded, or measured now); only
        the intensity comparison reads it."""
        if not self.intensity_switch and not self.step_times:
            return
        if self.step_times:
            table = StepTimes.load(self.step_times)
        else:
            table = profile_step_times(engine, self.profile_decode_batch_sizes,
                                       self.profile_prefill_tokens, self.profile_context_len,
                                       keys=("strategy.profile_decode_batch_sizes",
                                             "strategy.profile_prefill_tokens"))
        engine.info["step_times"] = table.to_json()
        for rep in engine.replicas:
            rep.scheduler.step_times = table

    @classmethod
    def applies_to(cls, tp: int, pp: int, dp: int) -> bool:
        return pp >= 2          # a pipeline mechanism: nothing to do without stages

    def layout_note(self, parallel) -> Optional[str]:
        return self.pipeline_only_note(parallel)

    def idle_switches(self) -> list[tuple[str, str]]:
        return [
            *self.idle_unless(not self.greedy_prefill, "strategy.greedy_prefill is true (the "
                              "occupancy ratio is its ablation's switch point)",
                              "kv_occupancy_ratio"),
            *self.idle_unless(self.greedy_prefill, "strategy.greedy_prefill is false (prompts "
                              "are held back by Algorithm 1's forecast, which it turns off)",
                              "admit_within_capacity"),
            *self.idle_unless(not self.intensity_switch, "strategy.intensity_switch is true (the "
                              "finished ratio is its ablation's switch point)", "finished_ratio"),
            *self.idle_unless(self.unsure_upper_forecast,
                              "strategy.unsure_upper_forecast is false", "unsure_confidence")]

    @classmethod
    def search_params(cls, knobs: SchedulerConfig) -> list[tuple[str, dict]]:
        return [("tdpipe", {"name": "tdpipe", **batching(knobs)})]


register_strategy("tdpipe", TDPipeParams)
