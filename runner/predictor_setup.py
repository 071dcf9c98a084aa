"""The job's output-length predictor, built from the recipe's `predictor` section before the
engine: `auto` resolves through predictors/auto.py (over the runs beside this one, this run's own
directory left out), the others through the predictor registry."""
from __future__ import annotations

from pathlib import Path
from typing import Optional


def build_job_predictor(recipe, output_dir: Path) -> tuple[Optional[object], Optional[dict]]:
    """-> (the predictor, None for no prediction pass at all; what `auto` chose and why)."""
    cfg = recipe.predictor
    device = recipe.device.device
    if cfg.name == "auto":
        from batchinfer.engine.model.sources import model_id_for
        from batchinfer.predictors.auto import choose_predictor

        model = recipe.model
        # auto picks where to run too: the CPU (~3 ms a request) unless the recipe names a device
        predictor, choice = choose_predictor(
            cfg, model_id_for(model.path, model.load_format == "dummy", model.hf_overrides), Path(output_dir).parent,
            "cpu" if device == "auto" else device, recipe.strategy.reads_length_forecasts(),
            exclude=Path(output_dir))
        return predictor, choice.to_json()
    if cfg.name == "none":
        return None, None
    from batchinfer.predictors import make_predictor

    return make_predictor(cfg, device=None if device == "auto" else device), None
