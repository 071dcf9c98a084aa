"""Output-length predictors: TD-Pipe's BERT classifier, the mean / oracle / none baselines, and
their training and evaluation on the runner's own history (history.jsonl in every run directory).

Light imports only here: torch and transformers load when a BERT predictor is built or trained.
"""
from .base import (LengthPredictor, LengthQuery, PredictorError, make_predictor,  # noqa: F401
                   register_predictor)
