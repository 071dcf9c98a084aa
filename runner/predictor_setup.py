"""The job's output-length predictor, built from the recipe's `predictor` section before the
engine: `auto` resolves through predictors/auto.py (over the runs beside this one, this run's own
directory left out), the others through the predictor registry. With `predictor.online` the
predictor is wrapped to learn from the job itself (predictors/online.py); `apply_forecasts` and
`learn` are the job loop's side of that."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Optional

log = logging.getLogger(__name__)

ONLINE_BASES = ("bert", "mean")      # what learns from the job (oracle knows, none is a bound)


def build_job_predictor(recipe, output_dir: Path) -> tuple[Optional[object], Optional[dict]]:
    """-> (the predictor, None for no prediction pass at all; what `auto` chose and why)."""
    cfg = recipe.predictor
    device = recipe.device.device
    if device == "cuda" and cfg.name != "none":
        from batchinfer.engine.build import resolve_device

        resolve_device(device)   # none here: the engine's usage error, not the predictor's crash
    if cfg.name == "auto":
        from batchinfer.engine.model.sources import model_id_for
        from batchinfer.predictors.auto import choose_predictor

        model = recipe.model
        # auto picks where to run too: the CPU (~3 ms a request) unless the recipe names a device
        predictor, choice = choose_predictor(
            cfg, model_id_for(model.path, model.load_format == "dummy", model.hf_overrides), Path(output_dir).parent,
            "cpu" if device == "auto" else device, recipe.strategy.reads_length_forecasts(),
            exclude=Path(output_dir))
        return wrap_online(predictor, cfg), choice.to_json()
    if cfg.name == "none":
        return None, None
    from batchinfer.predictors import make_predictor

    predictor = make_predictor(cfg, device=None if device == "auto" else device)
    choice = _named_choice(recipe, predictor)     # before wrapping: a mean may pick its model
    return wrap_online(predictor, cfg), choice


def _named_choice(recipe, predictor) -> Optional[dict]:
    """For a predictor the recipe names: what the report should say of it (its path; None:
    nothing to add). A trained predictor whose card lists other models than the job's forecasts their
    replies' lengths, and a strategy that reads no forecast only pays for it: both are said
    (logged, and in report.json's `predictor` / report.md's "Length predictor")."""
    from batchinfer.engine.model.sources import model_id_for

    cfg, model = recipe.predictor, recipe.model
    notes = []
    card = getattr(predictor, "card", None)
    trained_for = ((card.get("data") or {}).get("models") or []) if isinstance(card, dict) else []
    job_model = model_id_for(model.path, model.load_format == "dummy", model.hf_overrides)
    if trained_for and job_model not in trained_for:
        notes.append(f"trained on the replies of {', '.join(map(str, trained_for))}, not of this "
                     f"job's model {job_model}: its forecasts are that model's lengths")
    chose = getattr(predictor, "for_model", None)      # a mean over a history of several models
    note = chose(job_model) if chose is not None else None
    if note:
        notes.append(f"mean output length {predictor.mean:.1f} tokens: {note}")
    if not recipe.strategy.reads_length_forecasts():
        notes.append(f"strategy {recipe.strategy.name} reads no length forecast: the predictor "
                     "only records predicted_tokens in history.jsonl")
    if not notes:
        return {"name": cfg.name, "path": cfg.path} if cfg.path else None
    reason = "; ".join(notes)
    log.warning("length predictor %s (%s): %s", cfg.name, cfg.path, reason)
    return {"name": cfg.name, "path": cfg.path, "reason": reason}


def wrap_online(predictor: Optional[Any], cfg) -> Optional[Any]:
    """`predictor` learning from the job (predictors/online.py) when `cfg.online` says so and
    it can; else `predictor` itself."""
    if predictor is None:
        return None
    predictor.upper_percentile = getattr(cfg, "upper_percentile", predictor.upper_percentile)
    if not getattr(cfg, "online", False) or predictor.name not in ONLINE_BASES:
        return predictor
    from batchinfer.predictors.online import OnlineLengthPredictor

    return OnlineLengthPredictor(predictor, refit_every=cfg.online_refit_every,
                                 min_examples=cfg.online_min_examples,
                                 prior_weight=cfg.online_prior_weight, head=cfg.online_head,
                                 censored=cfg.online_censored,
                                 impute=getattr(cfg, "online_impute", "job"),
                                 tail_weight=getattr(cfg, "online_tail_prior_weight", 32.0),
                                 head_se=getattr(cfg, "online_head_se", 1.0),
                                 upper_percentile=cfg.upper_percentile)


def apply_forecast(request: Any, forecast: Any) -> None:
    """What the scheduler reads (Request.predicted_output_len / _upper / predicted_confidence)
    and what history.jsonl records (payload.predicted_tokens: the latest forecast)."""
    request.predicted_output_len = forecast.point
    request.predicted_output_upper = forecast.upper
    request.predicted_confidence = forecast.confidence
    payload = getattr(request, "payload", None)
    if payload is not None:
        payload.predicted_tokens = forecast.point


def learn(predictor: Any, engine: Any, outputs: Iterable[Any], now: Optional[float]) -> None:
    """The finished `outputs` of one engine step are labelled examples; when a refit is due it
    runs here, between steps, and the unfinished requests get their new forecasts. Nothing here
    can fail the job."""
    observe = getattr(predictor, "observe", None)
    if observe is None:
        return
    try:
        from batchinfer.engine.request import FinishReason

        for out in outputs:
            if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                # of n samples the first's length (the forecast is one reply's)
                observe(out.request_id, len(out.output_token_ids), now)
            else:
                predictor.forget(out.request_id)
        if predictor.due():
            progress = getattr(engine, "progress", None)
            for request, forecast in predictor.update(progress() if progress else None):
                apply_forecast(request, forecast)
    except Exception as exc:  # noqa: BLE001 - an optimisation never fails the job
        log.warning("online length predictor: %s: %s (the forecasts stay as they are)",
                    type(exc).__name__, exc)
