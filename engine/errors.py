"""Errors the engine raises on purpose, each carrying what the user needs to fix it."""
from __future__ import annotations


class BatchInferError(Exception):
    """Base class: anything raised here has a message fit to show a user as is."""


class ConfigError(BatchInferError):
    """A recipe, layout or option that cannot work. The job stops before it starts (exit 2)."""


class ModelLoadError(BatchInferError):
    """Weights, config or tokenizer that cannot be loaded: names the file and what was expected."""


class RequestError(BatchInferError):
    """One request cannot be served (e.g. prompt longer than max_model_len). Only it fails."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
