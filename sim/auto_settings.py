"""Resolving the settings a recipe leaves to `auto` (a strategy's `auto_keys()`, e.g. the two
layouts of a re-sharding strategy) before the engine is built, by the simulator.

Every alternative the strategy offers (`auto_search`) is simulated on the job's own prompts: the
first N usable requests of its input through the job's reader, chat template and tokenizer, with
output lengths as `batchinfer profile` takes them (sim/workload.py), and the engine's real
schedulers on simulated executors (sim/search.py's run_search, as `batchinfer profile` does). The
cost model is the strategy's choice: this machine's profile (made once, sim/profile_cache.py), a
saved profile table, or a hardware preset. The fastest alternative by simulated output tok/s is
the one the run uses; it is logged beside the others and recorded (`AutoResolution.record`, the
report's `auto_settings`). A simulation reads no wall clock, so the same input and cost model give
the same choice, on every shard and every resume.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import yaml

from batchinfer.engine.errors import ConfigError

from .planner import CostSetup, measured_setup, preset_setup
from .search import Candidate, run_search
from .simulator import sampling_knobs
from .workload import load_workload

log = logging.getLogger("batchinfer")


@dataclass
class AutoResolution:
    recipe: object       # the recipe with nothing left to auto
    record: dict         # what report.json keeps: the choice, every alternative, the inputs


def check_costs_name(costs: str, key: str) -> None:
    """ConfigError naming `key` where `costs` is neither measured, a preset nor a file (what
    `batchinfer validate` can tell before any model loads)."""
    from .hardware import PRESETS

    if costs != "measured" and costs.lower() not in PRESETS and not Path(costs).is_file():
        raise ConfigError(f"{key}: {costs!r} is neither measured, a hardware preset nor a profile "
                          f"table file; allowed: measured, a path to a profile_table.json (from "
                          f"`batchinfer profile`), or one of {', '.join(sorted(PRESETS))}")


def check_some_alternative_runs(config, arch, check: Callable[[object], None]) -> None:
    """Before the simulation (`batchinfer validate`, `run --dry-run`): a ConfigError, as the run
    would give after simulating, where `check` (the build's refusals, given an alternative's
    engine config) refuses every alternative the strategy's auto settings leave open."""
    from .search import Candidate, candidate_config

    strategy = config.strategy
    search = strategy.auto_search(config.parallel, arch)
    refused = []
    for alt in search.alternatives:
        cand = Candidate(alt.label, alt.strategy.model_dump(mode="json"), alt.tp, alt.pp,
                         config.parallel.dp)
        try:
            check(candidate_config(config, cand))
            return
        except ConfigError as exc:
            refused.append(f"{alt.label}: {str(exc).splitlines()[0]}")
    named = ", ".join(f"strategy.{k}" for k in strategy.auto_keys())
    raise ConfigError(f"{named}: auto found no alternative that can run: " + "; ".join(refused))


def cost_setup(costs: str, key: str, recipe, model, ranks: int) -> CostSetup:
    """measured | a profile table (.json / .csv) | a hardware preset -> the simulator's costs."""
    from .hardware import PRESETS
    from .profile_cache import cached_profile

    if costs == "measured":
        return measured_setup(recipe, model, cached_profile(recipe.engine_config()), Path("."),
                              ranks, lambda *args: None)
    if costs.lower() in PRESETS:
        return preset_setup(model, costs.lower(), ranks, None)
    check_costs_name(costs, key)
    path = Path(costs)
    try:
        return measured_setup(recipe, model, path, Path("."), ranks, lambda *args: None)
    except (ValueError, KeyError, OSError) as exc:
        raise ConfigError(f"{key}: {path}: not a profile table ({type(exc).__name__}: "
                          f"{exc})") from None
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def resolve_auto_settings(recipe, input_path: Path,
                          limit: Optional[int] = None) -> Optional[AutoResolution]:
    """None when the recipe leaves nothing to auto. `limit`: the job runs only its first
    `limit` requests, so only those are simulated."""
    from batchinfer.engine.runtime.build import model_setup

    strategy = recipe.strategy
    keys = strategy.auto_keys()
    if not keys:
        return None
    t0 = time.perf_counter()
    config = recipe.engine_config()
    model = model_setup(config)                  # config.json and tokenizer, no weights
    search = strategy.auto_search(config.parallel, model.arch)
    setup = cost_setup(search.costs, search.costs_key, recipe, model,
                       config.parallel.tp * config.parallel.pp * config.parallel.dp)
    sample = search.sample_requests if limit is None else min(limit, search.sample_requests)
    workload = load_workload(recipe, Path(input_path), model.tokenizer, model.max_model_len,
                             sample)
    named = ", ".join(f"strategy.{k}" for k in keys)
    if not workload.requests:
        raise ConfigError(f"{named}: auto is chosen by simulating the job's prompts, and "
                          f"{input_path} has no usable request ({workload.skipped})")
    cands = [Candidate(alt.label, alt.strategy.model_dump(mode="json"), alt.tp, alt.pp,
                       config.parallel.dp) for alt in search.alternatives]
    ranked = run_search(config, cands, workload.requests, setup.cost, setup.arch,
                        model.max_model_len, setup.dtype_bytes, setup.cores,
                        sampling=sampling_knobs(recipe.sampling))
    best = ranked[0]
    if best.result is None:
        raise ConfigError(f"{named}: auto found no alternative that can run: "
                          + "; ".join(f"{c.label}: {c.skipped}" for c in ranked))
    record = _record(keys, best, ranked, setup, workload, search.costs, time.perf_counter() - t0)
    _log(named, record)
    return AutoResolution(resolved_recipe(recipe, best), record)


def resolved_recipe(recipe, best: Candidate):
    """The recipe with the chosen strategy parameters and parallel layout."""
    from batchinfer.runner.recipe import parse_recipe

    data = yaml.safe_load(recipe.to_yaml())
    data["strategy"] = dict(best.strategy)
    parallel = dict(data.get("parallel") or {})
    if parallel.get("pp") != best.pp:
        parallel["pp_layers"] = None
    parallel.update(tp=best.tp, pp=best.pp)
    data["parallel"] = parallel
    return parse_recipe(data, "the recipe with its auto settings resolved")


def _record(keys, best, ranked, setup, workload, costs, seconds) -> dict:
    def row(cand: Candidate) -> dict:
        out = {"label": cand.label, "tp": cand.tp, "pp": cand.pp}
        if cand.result is not None:
            out["simulated_output_tok_per_s"] = round(cand.result.output_tok_per_s, 2)
            out["simulated_elapsed_s"] = round(cand.result.elapsed_s, 4)
        else:
            out["skipped"] = cand.skipped
        return out

    keys_set = set(keys)
    chosen = {k: v for k, v in best.strategy.items() if k in keys_set}
    if "prefill_layout" in keys_set:        # what `auto` meant for the parallel section
        chosen.pop("prefill_layout", None)
        chosen["parallel"] = {"tp": best.tp, "pp": best.pp}
    return {"keys": list(keys), "chosen": chosen, "label": best.label,
            "alternatives": [row(c) for c in ranked], "costs": costs,
            "cost_model": setup.description, "workload": workload.summary(),
            "seconds": round(seconds, 3), "simulated": True}


def _log(named: str, record: dict) -> None:
    best = record["alternatives"][0]["simulated_output_tok_per_s"]
    w = record["workload"]
    lines = [f"{named} = auto: {record['label']} (simulated on {w['requests']} of the job's "
             f"requests, mean prompt {w['mean_prompt_tokens']} / output "
             f"{w['mean_output_tokens']} tokens; costs: {record['costs']}; "
             f"{record['seconds']:.1f} s)"]
    for i, alt in enumerate(record["alternatives"]):
        mark = "  <- chosen" if i == 0 else ""
        if "skipped" in alt:
            lines.append(f"  {alt['label']:<40} skipped: {alt['skipped']}")
        else:
            tok = alt["simulated_output_tok_per_s"]
            lines.append(f"  {alt['label']:<40} {tok:>12,.1f} out tok/s (simulated, "
                         f"{tok / best:.2f}x){mark}")
    log.info("\n".join(lines))
