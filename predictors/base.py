"""The output-length predictor interface and the factory that builds one from a recipe.

    predictor = make_predictor(recipe.predictor)
    lengths = predictor.predict(requests)      # one call per batch, list[int], same order

`requests` are engine Requests (what the job admits) or LengthQuery objects (what eval builds
from history); strategies only ever call `predict`. Every prediction is capped at the request's
max_tokens: an output can never be longer, whatever the model guesses.

    none    no knowledge: each request's max_tokens (the only safe bound), 0 when unbounded
    mean    the mean output length of a history (a trained predictor's, or a run directory's)
    oracle  the true length, read from the input line (benchmarks that replay a trace)
    bert    TD-Pipe / μ-Serve's BERT length classifier (predictors/bert.py)
"""
from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from batchinfer.engine.errors import ConfigError

from .classes import means_past_cap

log = logging.getLogger(__name__)

PREDICTOR_CARD = "predictor.json"


class PredictorError(ConfigError):
    """A predictor that cannot be built or trained as asked (bad directory, too little data)."""


@dataclass(frozen=True)
class LengthQuery:
    """What a predictor may look at for one request."""

    text: str
    prompt_tokens: int = 0
    max_tokens: Optional[int] = None
    oracle: Optional[int] = None         # the true length, when the input carries it
    key: Optional[str] = None            # identifies it to the online learner (predictors/online.py)


def oracle_value(request: Any, oracle_field: str) -> Optional[int]:
    """The true output length an input line carries in `oracle_field`: `max_tokens` (a replayed
    trace sets it to the recorded length, with ignore_eos) or `metadata.<key>`."""
    if oracle_field == "max_tokens":
        sampling = getattr(request, "sampling", None)
        return getattr(sampling, "max_tokens", None)
    key = oracle_field.split(".", 1)[1]
    metadata = getattr(getattr(request, "payload", None), "metadata", None) or {}
    value = metadata.get(key)
    if isinstance(value, bool):
        return None
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def as_query(request: Any, oracle_field: str = "max_tokens") -> LengthQuery:
    """An engine Request (or a LengthQuery, returned as is) -> LengthQuery."""
    if isinstance(request, LengthQuery):
        return request
    payload = getattr(request, "payload", None)
    text = getattr(payload, "prompt_text", None)
    if text is None:
        text = request.prompt if isinstance(getattr(request, "prompt", None), str) else ""
    sampling = getattr(request, "sampling", None)
    return LengthQuery(text=text, prompt_tokens=len(getattr(request, "prompt_token_ids", ()) or ()),
                       max_tokens=getattr(sampling, "max_tokens", None),
                       oracle=oracle_value(request, oracle_field))


def cap(length: float, max_tokens: Optional[int]) -> int:
    value = max(int(round(length)), 0)
    return min(value, max_tokens) if max_tokens is not None else value


@dataclass(frozen=True)
class Forecast:
    """One request's forecast: the point (what Algorithm 1 reads), the `upper_percentile` of the
    predictor's length distribution and how sure it is (the predicted class's probability);
    None where the predictor cannot say."""

    point: int
    upper: Optional[int] = None
    confidence: Optional[float] = None


DEFAULT_UPPER_PERCENTILE = 75.0


def class_forecasts(probs: Any, means: Sequence[float], edges: Sequence[float],
                    queries: Sequence[LengthQuery], percentile: float,
                    tail: Optional[dict] = None) -> list[Forecast]:
    """A length classifier's forecasts: the most likely class's mean (μ-Serve's rule; for a
    request allowed more tokens than the training outputs that were cut, classes.means_past_cap
    with `tail`), as upper the upper edge of the class where the cumulative class probability
    reaches `percentile` (the last class has no upper edge: max_tokens, else its mean),
    confidence the most likely class's probability."""
    import numpy as np

    probs = np.asarray(probs, dtype=np.float64)
    out = []
    for row, q in zip(probs, queries):
        best = int(row.argmax())
        k = int(np.searchsorted(np.cumsum(row), percentile / 100.0 - 1e-9))
        k = min(max(k, best), len(means) - 1)
        if k + 1 < len(edges):
            upper = float(edges[k + 1])
        else:
            upper = float(q.max_tokens) if q.max_tokens is not None else float(means[k])
        point = cap(means_past_cap(means, tail, q.max_tokens)[best], q.max_tokens)
        out.append(Forecast(point, max(cap(upper, q.max_tokens), point), float(row[best])))
    return out


class LengthPredictor(ABC):
    """Predicts each request's number of output tokens, a batch at a time."""

    name: str = "?"

    def __init__(self, oracle_field: str = "max_tokens"):
        self.oracle_field = oracle_field
        self.calls = 0
        self.requests = 0
        self.seconds = 0.0

    def predict(self, requests: Sequence[Any]) -> list[int]:
        return self._timed(self.predict_queries, requests)

    def _timed(self, method, requests: Sequence[Any]) -> list:
        """`method` over the requests' queries, its cost counted in stats()."""
        queries = [as_query(r, self.oracle_field) for r in requests]
        if not queries:
            return []
        t = time.perf_counter()
        out = method(queries)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        self.requests += len(queries)
        return out

    @abstractmethod
    def predict_queries(self, queries: Sequence[LengthQuery]) -> list[int]:
        ...

    upper_percentile: float = DEFAULT_UPPER_PERCENTILE

    def forecast(self, requests: Sequence[Any]) -> list[Forecast]:
        """Forecasts with their uncertainty (predict's points, the same cost); a predictor that
        knows no distribution gives points alone."""
        return self._timed(self.forecast_queries, requests)

    def forecast_queries(self, queries: Sequence[LengthQuery]) -> list[Forecast]:
        return [Forecast(p) for p in self.predict_queries(queries)]

    def stats(self) -> dict:
        """Inference cost so far (the job reports it as a share of its time)."""
        return {"name": self.name, "calls": self.calls, "requests": self.requests,
                "seconds": round(self.seconds, 4),
                "ms_per_request": round(1e3 * self.seconds / self.requests, 4)
                if self.requests else None}

    def describe(self) -> dict:
        return {"name": self.name}


class NonePredictor(LengthPredictor):
    name = "none"

    def predict_queries(self, queries: Sequence[LengthQuery]) -> list[int]:
        return [q.max_tokens if q.max_tokens is not None else 0 for q in queries]


class MeanPredictor(LengthPredictor):
    name = "mean"

    def __init__(self, mean: float, oracle_field: str = "max_tokens", source: str = "",
                 by_model: Optional[dict] = None):
        super().__init__(oracle_field)
        self.mean = float(mean)
        self.source = source
        self.by_model = by_model or {}     # model -> (records, their output tokens summed)

    def for_model(self, model: Optional[str]) -> Optional[str]:
        """Over a history of several models, the mean of the job's own model's records where it
        has any (history.models_for_job); -> what to say of the choice, None: nothing."""
        from collections import Counter

        from .history import models_for_job

        chosen, note = models_for_job(Counter({m: n for m, (n, _) in self.by_model.items()}),
                                      model)
        if chosen is not None:
            count = sum(n for m, (n, _) in self.by_model.items() if m in chosen)
            self.mean = sum(s for m, (_, s) in self.by_model.items() if m in chosen) / count
        return note

    def predict_queries(self, queries: Sequence[LengthQuery]) -> list[int]:
        return [cap(self.mean, q.max_tokens) for q in queries]

    def describe(self) -> dict:
        return {"name": self.name, "mean": round(self.mean, 3), "source": self.source}


class OraclePredictor(LengthPredictor):
    name = "oracle"

    def __init__(self, oracle_field: str = "max_tokens"):
        super().__init__(oracle_field)
        self.missing = 0

    def predict_queries(self, queries: Sequence[LengthQuery]) -> list[int]:
        out = []
        for q in queries:
            if q.oracle is None:
                # a line without the field: fall back to the cap (never fail the request)
                self.missing += 1
                if self.missing == 1:
                    log.warning("oracle predictor: a request has no %s; predicting its "
                                "max_tokens instead (further ones are only counted)",
                                self.oracle_field)
                out.append(q.max_tokens if q.max_tokens is not None else 0)
            else:
                out.append(cap(q.oracle, q.max_tokens))
        return out

    def stats(self) -> dict:
        return {**super().stats(), "missing_oracle": self.missing}

    def describe(self) -> dict:
        return {"name": self.name, "oracle_field": self.oracle_field}


def mean_predictor(cfg: Any) -> MeanPredictor:
    """The mean output length of `cfg.path`: a trained predictor's training mean, or the mean
    over a run directory's history (kept per model: MeanPredictor.for_model)."""
    path = Path(cfg.path)
    card_path = path / PREDICTOR_CARD
    if card_path.is_file():
        import json

        card = json.loads(card_path.read_text(encoding="utf-8"))
        return MeanPredictor(float(card["classes"]["train_mean"]), cfg.oracle_field,
                             source=str(cfg.path))
    from .history import read_history

    data = read_history([path])
    if not data.records:
        raise PredictorError(f"{path}: the history holds no usable records")
    by_model: dict = {}
    for record in data.records:
        count, total = by_model.get(record.model, (0, 0))
        by_model[record.model] = (count + 1, total + record.output_tokens)
    mean = sum(r.output_tokens for r in data.records) / len(data.records)
    return MeanPredictor(mean, cfg.oracle_field, source=str(cfg.path), by_model=by_model)


# name -> factory(config, device) -> LengthPredictor
PREDICTORS: dict[str, Callable[[Any, Optional[str]], LengthPredictor]] = {
    "none": lambda cfg, device: NonePredictor(cfg.oracle_field),
    "oracle": lambda cfg, device: OraclePredictor(cfg.oracle_field),
    "mean": lambda cfg, device: mean_predictor(cfg),
}


def _bert(cfg: Any, device: Optional[str]) -> LengthPredictor:
    return bert_from_dir(cfg, Path(cfg.path), device)


def bert_from_dir(cfg: Any, path: Path, device: Optional[str]) -> LengthPredictor:
    from .bert import BertLengthPredictor

    return BertLengthPredictor.load(path, device=device, batch_size=cfg.batch_size,
                                    oracle_field=cfg.oracle_field,
                                    encoder_int8=getattr(cfg, "encoder_int8", "auto"),
                                    encoder_bf16_attention=getattr(cfg, "encoder_bf16_attention",
                                                                   "auto"))


PREDICTORS["bert"] = _bert


def register_predictor(name: str, factory: Callable[[Any, Optional[str]], LengthPredictor]) -> None:
    PREDICTORS[name] = factory


def make_predictor(cfg: Any, device: Optional[str] = None) -> LengthPredictor:
    """The predictor a recipe's `predictor` section (PredictorConfig) names."""
    factory = PREDICTORS.get(cfg.name)
    if factory is None:
        raise PredictorError(f"predictor.name: unknown predictor {cfg.name!r}; known: "
                             f"{', '.join(sorted(PREDICTORS))}")
    try:
        return factory(cfg, device)
    except PredictorError as exc:
        raise PredictorError(f"predictor.path: {exc}") from None
    except (OSError, ValueError, KeyError) as exc:
        raise PredictorError(f"predictor.path {cfg.path}: cannot build the {cfg.name} predictor "
                             f"({type(exc).__name__}: {exc})") from None
