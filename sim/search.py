"""Every applicable strategy x (tp, pp, dp) layout, simulated and ranked by output tok/s.

Layouts use all `devices` (tp * pp * dp = devices; on a CPU host the single process with every
core is a candidate too); TP needs head counts it divides, PP at most one stage per layer.
Strategies: each registered strategy's `search_params` (the baselines SB and HB, and the pipeline
schedules and shared-weight replicas that offer themselves), at the layouts its `applies_to`
accepts, and the recipe's own strategy with its parameters (a strategy that only the recipe names
is simulated when it does: e.g. one whose gains come from host work only the GPU presets price,
or whose helper cores are the recipe's to give). Batching knobs (max_num_seqs, the
token budget) come from the recipe. A layout the cost model or the engine rejects (the KV cache
cannot hold max_model_len, ...) is listed with its reason instead of a number.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from batchinfer.engine.config import EngineConfig, ParallelConfig
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.model.shard import check_tensor_parallel
from batchinfer.runner.recipe import strategy_class
from batchinfer.strategies import STRATEGIES, StrategyParams

from .simulator import SimRequest, SimResult, simulate


@dataclass
class Candidate:
    label: str
    strategy: dict
    tp: int
    pp: int
    dp: int
    result: Optional[SimResult] = None
    skipped: Optional[str] = None

    def row(self) -> dict:
        out = {"label": self.label, "strategy": self.strategy, "tp": self.tp, "pp": self.pp,
               "dp": self.dp}
        if self.result is not None:
            out["simulated"] = self.result.to_json()
        if self.skipped:
            out["skipped"] = self.skipped
        return out


def layouts(devices: int, arch, include_single: bool = False) -> list[tuple[int, int, int]]:
    """(tp, pp, dp) using all `devices` that the model can split into."""
    out = [(1, 1, 1)] if include_single and devices > 1 else []
    for tp in range(1, devices + 1):
        if devices % tp:
            continue
        if tp > 1:
            try:
                check_tensor_parallel(arch, tp)
            except ConfigError:
                continue
        rest = devices // tp
        for pp in range(1, rest + 1):
            if rest % pp == 0 and pp <= arch.num_layers:
                out.append((tp, pp, rest // pp))
    return out


def strategy_candidates(recipe_strategy: StrategyParams) -> list[tuple[str, dict]]:
    """(label, strategy parameters) with the recipe's batching knobs."""
    knobs = recipe_strategy.scheduler_config()
    out = [pair for cls in STRATEGIES.values() for pair in cls.search_params(knobs)]
    own = recipe_strategy.model_dump(mode="json")
    known = [strategy_class(s["name"]).model_validate(s).model_dump(mode="json") for _, s in out]
    if own not in known and recipe_strategy.simulated:
        out.append((f"recipe ({recipe_strategy.name})", own))
    return out


def candidates(recipe_strategy: StrategyParams, arch, devices: int,
               include_single: bool = False) -> list[Candidate]:
    out = []
    for label, strategy in strategy_candidates(recipe_strategy):
        cls = strategy_class(strategy["name"])
        if not cls.runs_model(arch):
            continue
        for tp, pp, dp in layouts(devices, arch, include_single):
            if cls.applies_to(tp, pp, dp):
                out += _spelled_out(Candidate(label, strategy, tp, pp, dp), cls, arch)
    return out


def _spelled_out(cand: Candidate, cls, arch) -> list[Candidate]:
    """A strategy whose parameters leave settings to `auto` (resolved per job when it runs): one
    candidate per alternative at this layout, so the ranking shows each."""
    params = cls.model_validate(cand.strategy)
    if not params.auto_keys():
        return [cand]
    try:
        search = params.auto_search(ParallelConfig(tp=cand.tp, pp=cand.pp, dp=cand.dp), arch)
    except ConfigError as exc:
        cand.skipped = str(exc).splitlines()[0]
        return [cand]
    return [Candidate(f"{cand.label} {alt.label}", alt.strategy.model_dump(mode="json"), cand.tp,
                      cand.pp, cand.dp) for alt in search.alternatives
            if (alt.tp, alt.pp) == (cand.tp, cand.pp)]


def candidate_config(base: EngineConfig, cand: Candidate) -> EngineConfig:
    params = strategy_class(cand.strategy["name"]).model_validate(cand.strategy)
    parallel = base.parallel.model_dump()
    parallel.update(tp=cand.tp, pp=cand.pp, dp=cand.dp)
    if cand.pp != base.parallel.pp:
        parallel["pp_layers"] = None
    return EngineConfig(model=base.model, cache=base.cache, device=base.device,
                        parallel=parallel, scheduler=params.scheduler_config(), strategy=params)


def run_search(base: EngineConfig, cands: list[Candidate], requests: list[SimRequest], cost,
               arch, max_model_len: int, dtype_bytes: int, cores: int,
               progress: Optional[Callable[[Candidate, int, int], None]] = None,
               sampling: Optional[dict] = None) -> list[Candidate]:
    """Simulates each candidate, every request sampling with `sampling` (SamplingParams fields;
    greedy when None); -> the simulated ones best first, then the skipped ones.
    progress(candidate, done, total) after each."""
    for done, cand in enumerate(cands, 1):
        if not cand.skipped:
            try:
                config = candidate_config(base, cand)   # a strategy that cannot serve the
                cand.skipped = config.strategy.lora_refusal(base.model, arch)   # adapters: out
                if not cand.skipped:
                    cand.result = simulate(config, requests, cost, arch, max_model_len,
                                           dtype_bytes, cores, sampling)
            except (ConfigError, ValueError) as exc:
                cand.skipped = str(exc).splitlines()[0]
        if progress is not None:
            progress(cand, done, len(cands))
    ran = sorted((c for c in cands if c.result is not None),
                 key=lambda c: -c.result.output_tok_per_s)
    return ran + [c for c in cands if c.result is None]
