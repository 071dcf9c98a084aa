"""What a strategy is: its recipe parameters (a StrategyParams) and the hooks the rest of the
product calls, so that nothing outside `strategies/<name>/` (and `resharding/`, Seesaw's
machinery) names a strategy.

A strategy provides, on its parameter model:
- its scheduler: `scheduler_config()` (the batching knobs the job reads) and `make_scheduler()`;
- its refusals of a recipe that need only the model's config: `check_config(config, arch)`;
- optionally an engine of its own making: `build_engine(config)` (its executor, and a
  `engine.runtime.worker_extension.WorkerExtension` its workers run: setup, execute, message,
  close), and `prepare(engine)` once the engine is built;
- its simulator model: `simulated_replicas(sim)` (None: the simulator's standard pipeline,
  with `simulated_executor_options(layout)`);
- the layouts it applies to: `applies_to(tp, pp, dp)`, the models it can run: `runs_model(arch)`,
  and the parameters `batchinfer profile` tries for it: `search_params(knobs)`;
- settings a recipe may leave to `auto` that a simulation of the job decides before the engine is
  built: `auto_keys()` and `auto_search(parallel, arch)` (sim/auto_settings.py runs it);
- its report statistics: the generic `strategy_summary()` / `step_stats()` of its scheduler and
  executor (engine/scheduler.py, engine/executor.py), which metrics and plots render without
  knowing the strategy.
A new strategy is a folder here and one line in strategies/__init__.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from pydantic import ConfigDict, Field

from batchinfer.engine.config import SchedulerConfig
from batchinfer.engine.strict_numbers import NumbersNotBooleans


class StrategyParams(NumbersNotBooleans):
    """Base of every strategy's parameter model; `name` selects the strategy."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    name: str = "baseline"
    # False: `batchinfer profile` has no model of it (an external engine) and leaves it out
    simulated: ClassVar[bool] = True
    # True: its schedulers count KV through the standard block manager alone, so a model whose
    # windowed layers alternate with global ones runs with a block table per layer group
    # (engine/kv_groups.py); False: one table per sequence, every block kept
    kv_layer_groups: ClassVar[bool] = False
    # True: its scheduler brings sequences preempted to the swap area back (its scheduler's
    # `swaps_preempted`, tests/engine/test_kv_swap.py holds the two together), so
    # memory.preemption_mode: swap gets an area; False: it recomputes, and an automatic CPU KV
    # budget keeps the area's memory (kv_swap.swap_area_used)
    swaps_preempted: ClassVar[bool] = True
    # True: another engine runs the job and sizes its KV cache its own way (the engine's
    # preflight then leaves memory.kv_cache_memory to it)
    external_engine: ClassVar[bool] = False
    # False: its workers build model partitions of their own, which apply no LoRA adapters
    # (model.lora_modules is refused at preflight, before any layout search or worker start)
    applies_lora: ClassVar[bool] = True

    def scheduler_config(self) -> SchedulerConfig:
        """The batching knobs the rest of the job reads (token budget, max_num_seqs)."""
        raise NotImplementedError

    def make_scheduler(self, block_manager, max_model_len: int, pipeline_depth: int):
        """One replica's Scheduler; the default is the baseline policy of scheduler_config()."""
        from batchinfer.engine.batching_policies import scheduler_from_config

        return scheduler_from_config(self.scheduler_config(), block_manager, max_model_len,
                                     pipeline_depth)

    def prepare(self, engine) -> None:
        """Runs once the engine is built, before any request (e.g. profiling step times)."""

    def build_engine(self, config):
        """An engine of the strategy's own making (Seesaw: two layouts over the same workers);
        None: the standard single- or multi-process engine."""
        return None

    def check_config(self, config, arch) -> None:
        """The strategy's refusals of a recipe that need only the model's config (the parallel
        layout it runs in, settings it cannot honour): a ConfigError. A strategy that builds
        its own engine makes the same checks there; `batchinfer validate` and `run --dry-run`
        call this before any model loads (engine.build.preflight)."""

    def lora_refusal(self, model_cfg, arch) -> Optional[str]:
        """Why the strategy cannot serve model.lora_modules' adapters on this model (None: it
        can): `batchinfer profile` leaves such a candidate out; the build refuses it."""
        if model_cfg.lora_modules and not self.applies_lora:
            return (f"model.lora_modules: strategy {self.name} builds its own model partitions, "
                    "which apply no LoRA adapters; leave model.lora_modules empty or run another "
                    "strategy")
        return None

    def check_kv_budget(self, config, arch, max_model_len: int, kv_bytes: int) -> bool:
        """For an explicit memory.kv_cache_memory, before any weight loads: a strategy that sizes
        its cache its own way raises the ConfigError its build would for kv_bytes-byte elements
        and returns True; False: the engine's own sizing applies (engine.build.preflight)."""
        return False

    def runs_embeddings(self) -> bool:
        """Whether an embedding job (`model.task: embed`) may run with it: the embedding
        engine's batching (build_engine None), or an engine of its own that embeds."""
        return False

    def reads_length_forecasts(self) -> bool:
        """Whether the scheduler uses each request's predicted output length; `predictor: auto`
        builds a predictor only for strategies that do."""
        return False

    def prepares_inputs_ahead(self) -> bool:
        """On the standard multi-process engine: each worker prepares a plan's inputs on its own
        thread as soon as the plan arrives, one plan ahead of its forward
        (engine/runtime/input_prep.py), instead of inline after the activations' receive."""
        return False

    # --- the simulator and `batchinfer profile` ------------------------------------------------
    def simulated_replicas(self, sim) -> Optional[list]:
        """The simulator's replicas when the strategy models its own executor (sim: a
        sim.simulator.SimSetup; write what the simulated engine should report to sim.info).
        None: the standard simulated pipeline, with simulated_executor_options()."""
        return None

    def simulated_executor_options(self, layout) -> dict:
        """Keyword options of the standard SimulatedExecutor for this strategy."""
        return {}

    @classmethod
    def applies_to(cls, tp: int, pp: int, dp: int) -> bool:
        """Whether the strategy means anything on this layout (profile skips it otherwise)."""
        return True

    def layout_note(self, parallel) -> Optional[str]:
        """A warning for a layout the strategy runs on but where its mechanism has nothing to
        do (`batchinfer validate` and `run --dry-run` print it, the engine logs it); None where
        it does."""
        return None

    def idle_switches(self) -> list[tuple[str, str]]:
        """(key, why) for each knob that a part switched off leaves with nothing to do (a
        knob of Compute as a Service under `compute_service: false`, say)."""
        return []

    @staticmethod
    def idle_unless(part_on: bool, why: str, *keys: str) -> list[tuple[str, str]]:
        """idle_switches' entries for `keys`, a part's knobs, while the part is off."""
        return [] if part_on else [(key, why) for key in keys]

    def notes(self, parallel) -> list[str]:
        """Every warning for this strategy section on this layout: layout_note, and the knobs
        the recipe sets that a part switched off leaves unused (said, not refused: an ablation
        recipe keeps its knobs)."""
        notes = [note for note in (self.layout_note(parallel),) if note]
        idle: dict[str, list[str]] = {}
        for key, why in self.idle_switches():
            if key in self.model_fields_set:
                idle.setdefault(why, []).append(f"strategy.{key}")
        notes += [f"{', '.join(keys)} {'has' if len(keys) == 1 else 'have'} no effect: {why}"
                  for why, keys in idle.items()]
        return notes

    def pipeline_only_note(self, parallel) -> Optional[str]:
        """layout_note of a mechanism that works between pipeline stages: said at pp 1."""
        if parallel.pp >= 2:
            return None
        return (f"strategy {self.name} at parallel.pp {parallel.pp}: its mechanism works between "
                "pipeline stages (parallel.pp >= 2); on one stage it only schedules (docs/"
                f"strategies/{self.name}.md); set parallel.pp, or use strategy baseline")

    @classmethod
    def runs_model(cls, arch) -> bool:
        """Whether the strategy can run this model at all (profile skips it otherwise)."""
        return True

    @classmethod
    def search_params(cls, knobs: SchedulerConfig) -> list[tuple[str, dict]]:
        """(label, strategy section) pairs `batchinfer profile` simulates for the strategy, with
        the user's batching knobs; [] leaves it out of the search."""
        return []

    # --- settings left to `auto`, resolved by simulating the job before the engine is built ----
    def auto_keys(self) -> list[str]:
        """The parameters the recipe leaves to a simulation of the job; [] when none."""
        return []

    def auto_search(self, parallel, arch) -> "AutoSearch":
        """What resolving auto_keys() simulates over the ranks of `parallel` (the recipe's
        ParallelConfig): every alternative with nothing left to auto, what prices them and how
        many of the job's requests to run. ConfigError naming the key when none can run."""
        raise NotImplementedError


class BaselineStrategy(StrategyParams, SchedulerConfig):
    """vLLM-style continuous batching: policy sb (separate) or hb (hybrid chunked prefill)."""

    name: Literal["baseline"] = "baseline"
    kv_layer_groups: ClassVar[bool] = True
    prepare_ahead: bool = Field(False, description="pipeline workers prepare each plan's inputs "
                                "one plan ahead on a thread (the overlap SiPipe's token-safe "
                                "execution and gLLM's runtime have; off: inline, as vLLM)")

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(**self.model_dump(include=set(SchedulerConfig.model_fields)))

    def runs_embeddings(self) -> bool:
        return True          # the embedding engine, under max_num_seqs / max_num_batched_tokens

    def prepares_inputs_ahead(self) -> bool:
        return self.prepare_ahead

    @classmethod
    def search_params(cls, knobs: SchedulerConfig) -> list[tuple[str, dict]]:
        return [(f"baseline-{policy}", {"name": "baseline", "policy": policy, **batching(knobs)})
                for policy in ("sb", "hb")]


@dataclass(frozen=True)
class AutoAlternative:
    """One way to resolve a strategy's `auto` settings."""

    label: str                    # how the printout names it, e.g. "prefill pp=2 -> decode tp=2"
    strategy: StrategyParams      # nothing left to auto
    tp: int                       # the parallel section it runs with
    pp: int


@dataclass(frozen=True)
class AutoSearch:
    alternatives: list[AutoAlternative]
    costs: str                    # measured | a profile table's path | a hardware preset
    costs_key: str                # the recipe key `costs` came from, for errors
    sample_requests: int          # the first N usable requests of the job's input


def batching(knobs: SchedulerConfig) -> dict:
    """The batching knobs every searched strategy gets from the user's recipe."""
    return {"max_num_seqs": knobs.max_num_seqs,
            "max_num_batched_tokens": knobs.max_num_batched_tokens}


# name -> parameter model; each strategy's package registers its own (strategies/__init__.py)
STRATEGIES: dict[str, type[StrategyParams]] = {"baseline": BaselineStrategy}


def register_strategy(name: str, params: type[StrategyParams]) -> None:
    STRATEGIES[name] = params
