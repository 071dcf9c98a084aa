"""`batchinfer profile`'s work, without the terminal: pick the cost model (this machine's profile,
or a hardware preset), read the workload, simulate every candidate, write the winning recipe.

The CLI (cli/profile.py) renders what `plan` returns; benchmarks and tests call it directly.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import yaml

from batchinfer.engine.errors import ConfigError
from batchinfer.runner.shipped_files import shipped

from .search import Candidate, candidates, run_search
from .simulator import sampling_knobs
from .workload import Workload, load_workload

TABLE_FILE, RANKING_FILE, RECIPE_FILE = "profile_table.json", "ranking.json", "best_recipe.yaml"


@dataclass
class CostSetup:
    cost: object
    arch: object
    dtype_bytes: int
    cores: int           # CPU threads the ranks split (1 per GPU for a preset)
    devices: int         # ranks a layout may use
    description: dict = field(default_factory=dict)


def measured_setup(recipe, model, table_path: Optional[Path], out_dir: Path,
                   devices: Optional[int], progress: Callable[[str, int, int], None]) -> CostSetup:
    """This machine: the saved table, else a fresh profile (saved to out_dir for reuse).
    model: the recipe's ModelSetup (engine/runtime/build.py)."""
    from .cost_model import MeasuredCostModel
    from .profile_table import ProfileTable
    from .profiler import profile_machine

    from .shipped_tables import resolve_table

    config = recipe.engine_config()
    if table_path is not None:
        table_path = resolve_table(table_path)
        table = ProfileTable.load(table_path)
    else:
        table = profile_machine(config, progress=progress)
        out_dir.mkdir(parents=True, exist_ok=True)
        table_path = out_dir / TABLE_FILE
        table.save(table_path)
    if int(table.model["num_layers"]) != model.arch.num_layers or \
            int(table.model["hidden_size"]) != model.arch.hidden_size:
        overrides = " with model.hf_overrides" if config.model.hf_overrides else ""
        raise ConfigError(
            f"{table_path}: profiled for {table.model['model_id']} ({table.model['num_layers']} "
            f"layers, hidden {table.model['hidden_size']}), not the recipe's model "
            f"({model.model_id}{overrides}: {model.arch.num_layers} layers, hidden "
            f"{model.arch.hidden_size}); profile again without --table")
    measured = (table.model.get("quantization"), bool(table.model.get("quantize_lm_head")))
    asked = (config.model.quantization, config.model.quantize_lm_head)
    if measured != asked:
        raise ConfigError(f"{table_path}: profiled with model.quantization {measured[0] or 'empty'}"
                          f" (quantize_lm_head {str(measured[1]).lower()}), the recipe asks for "
                          f"{asked[0] or 'empty'} ({str(asked[1]).lower()}); profile again "
                          "without --table")
    cores = int(table.hardware.get("cores") or os.cpu_count() or 1)
    if table.hardware.get("device") == "cpu":
        world = devices or cores
    else:       # the GPUs of the machine it was measured on (tables before the count: 1)
        world = devices or int(table.hardware.get("gpus") or 1)
    return CostSetup(MeasuredCostModel(table), model.arch, table_dtype_bytes(table, model),
                     cores, world, {"hardware": "measured", "table": str(table_path),
                                    "device": table.hardware.get("device"), "cores": cores,
                                    **table_host(table)})


def table_host(table) -> dict:
    """Which machine a table timed and when, for the ranking's header: the CPU model (tables
    from before the profiler recorded it have none), the GPU, the date measured."""
    hw = table.hardware
    out = {"cpu_model": hw.get("cpu_model"), "card": hw.get("card"),
           "measured_on": str(hw.get("measured_at") or "")[:10] or None}
    return {k: v for k, v in out.items() if v}


def table_dtype_bytes(table, model) -> int:
    """The bytes of the model's number format a measured table was profiled in (the simulator
    sizes weights and KV with it). Tables from before the profiler recorded the engine's
    formats (no `kv_cache_dtype`) on a CPU said float32 whatever ran (a parameter's dtype, fp32
    beside bf16 linears): for them the recipe's model as this machine resolves it (model: its
    ModelSetup)."""
    if "kv_cache_dtype" not in table.model and table.hardware.get("device", "cpu") == "cpu":
        return int(model.dtype_bytes)
    return int(table.model["dtype_bytes"])


def preset_setup(recipe_model, hardware: str, devices: int, model: Optional[str]) -> CostSetup:
    """A preset GPU x `devices`, for the recipe's model (its ModelSetup) or a model preset."""
    from .hardware import RooflineCostModel, preset
    from .model_presets import model_preset

    spec = preset(hardware)
    arch = model_preset(model) if model else recipe_model.arch
    return CostSetup(RooflineCostModel(spec, arch), arch, 2, devices, devices,
                     {"hardware": spec.name, "gpus": devices, "model": model or "recipe",
                      "source": spec.source, "dtype": "bfloat16",
                      "prompt_tokens": "counted with the recipe model's tokenizer"})


def _read_on_this_machine(config, timed_elsewhere: bool):
    """The recipe's model as planning reads it here: config.json and tokenizer, no weights.

    A CUDA recipe planned where torch sees no GPU (a shipped table, a preset): its model read on
    the CPU, in the GPU's dtype (auto is bf16 there). timed_elsewhere (a --table or a preset): the
    step times come from another machine, so `model.quantization` is not checked against this
    CPU's instructions (the table's own quantization is checked against the recipe instead)."""
    import torch

    model, device = config.model, config.device
    if timed_elsewhere and model.quantization is not None:
        model = model.model_copy(update={"quantization": None, "quantize_lm_head": False})
    if device.device == "cuda" and not torch.cuda.is_available():
        if model.dtype == "auto":
            model = model.model_copy(update={"dtype": "bfloat16"})
        device = device.model_copy(update={"device": "cpu", "attention_backend": "torch"})
    return config.model_copy(update={"model": model, "device": device})


@dataclass
class PlanResult:
    ranked: list[Candidate]
    workload: Workload
    setup: CostSetup
    best_recipe: Optional[str]
    out_dir: Path

    def to_json(self) -> dict:
        return {"simulated": True, "cost_model": self.setup.description,
                "workload": self.workload.summary(), "ranking": [c.row() for c in self.ranked]}


def winning_recipe(recipe, best: Candidate, note: str, model: Optional[str] = None) -> str:
    """The recipe with the winner's strategy and layout, as YAML (checked by the recipe parser).
    model: the --model preset planned for, which the recipe's own model is not (preset_model)."""
    from batchinfer.runner.recipe import parse_recipe

    data = yaml.safe_load(recipe.to_yaml())
    notes = [note]
    if model:
        notes += preset_model(data, model)
    data["strategy"] = dict(best.strategy)
    parallel = dict(data.get("parallel") or {})
    if parallel.get("pp") != best.pp:
        parallel.pop("pp_layers", None)
    parallel.update(tp=best.tp, pp=best.pp, dp=best.dp)
    data["parallel"] = parallel
    parse_recipe(data, "the winning recipe")
    return "".join(f"# {line}\n" for line in notes) + yaml.safe_dump(data, sort_keys=False)


# the --model presets whose published config.json batchinfer ships (dummy weights): in the source
# tree, and in a wheel (runner/shipped_files.py)
SHIPPED_CONFIGS = shipped("examples/model-configs")


def preset_model(data: dict, name: str) -> list[str]:
    """A plan for a --model preset (its shapes only): the recipe's `model` section points at the
    preset's config.json with dummy weights where batchinfer ships it (examples/model-configs/),
    else stays the recipe's, which would run another model: -> the comment lines saying so."""
    folder = SHIPPED_CONFIGS / name.lower()
    if (folder / "config.json").is_file():
        data["model"] = {**data.get("model", {}), "path": str(folder), "load_format": "dummy",
                         "hf_overrides": {}}
        return [f"model: the preset {name}'s config.json with dummy weights (random): a run",
                "measures its speed and memory, its answers are noise; set model.path to its",
                "weights (and load_format: auto) to run the job itself"]
    path = (data.get("model") or {}).get("path")
    return [f"SET model.path BEFORE RUNNING: this plan is for the model preset {name} (its shapes",
            "only; neither its weights nor its config.json ship), and model.path below is the",
            f"recipe's ({path or 'empty: the embedded SmolLM2-135M'}), which is another model"]


def plan(recipe, input_path: Path, out_dir: Path, hardware: str = "measured",
         devices: Optional[int] = None, table: Optional[Path] = None, model: Optional[str] = None,
         max_requests: Optional[int] = 2000, history: Optional[list[Path]] = None,
         progress: Callable[[str, int, int], None] = lambda *args: None) -> PlanResult:
    """progress(what now, steps done, steps in all): the profile's steps, then the
    candidates'."""
    from batchinfer.engine.build import _max_model_len
    from batchinfer.engine.runtime.build import model_setup

    if hardware == "measured" and model:
        raise ConfigError("--model names a preset model for a preset --hardware; measured "
                          "profiles time the recipe's own model")
    # config.json and tokenizer, no weights
    timed_elsewhere = hardware != "measured" or table is not None
    recipe_model = model_setup(_read_on_this_machine(recipe.engine_config(), timed_elsewhere))
    if hardware == "measured":
        setup = measured_setup(recipe, recipe_model, table, out_dir, devices, progress)
        if setup.description.get("device") == "cpu" and devices and devices > setup.cores:
            raise ConfigError(
                f"--gpus {devices}: {setup.description.get('table')} timed a CPU host of "
                f"{setup.cores} cores, and a rank there runs on cores of its own (ranks sharing "
                "cores are not what it measured, and would be planned as if each had one); "
                f"give at most {setup.cores}")
    else:
        setup = preset_setup(recipe_model, hardware, devices or 4, model)
    max_len = _max_model_len(recipe.model.max_model_len, setup.arch)
    progress("reading the workload", 0, 1)
    workload = load_workload(recipe, input_path, recipe_model.tokenizer, max_len, max_requests,
                             history)
    if not workload.requests:
        raise ConfigError(f"{input_path}: no usable request to simulate ({workload.skipped})")
    cands = candidates(recipe.strategy, setup.arch, setup.devices,
                       include_single=hardware == "measured")
    ranked = run_search(recipe.engine_config(), cands, workload.requests, setup.cost, setup.arch,
                        max_len, setup.dtype_bytes, setup.cores,
                        lambda c, done, total: progress(
                            f"simulated {c.label} tp={c.tp} pp={c.pp} dp={c.dp}", done, total),
                        sampling=sampling_knobs(recipe.sampling))
    best = ranked[0] if ranked and ranked[0].result is not None else None
    text = None
    out_dir.mkdir(parents=True, exist_ok=True)
    if best is not None:
        hw = setup.description.get("hardware")
        note = (f"written by `batchinfer profile` ({hw}): simulated "
                f"{best.result.output_tok_per_s:.1f} output tok/s on {input_path.name}")
        text = winning_recipe(recipe, best, note, model)
        (out_dir / RECIPE_FILE).write_text(text)
    else:       # an earlier plan's winner in this directory would read as this one's
        (out_dir / RECIPE_FILE).unlink(missing_ok=True)
    result = PlanResult(ranked, workload, setup, text, out_dir)
    (out_dir / RANKING_FILE).write_text(json.dumps(result.to_json(), indent=1))
    return result
