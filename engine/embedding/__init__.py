"""Embedding jobs (`model.task: embed`): pooling config, requests, the engine."""
from __future__ import annotations

from .pooler_config import PoolerConfig
from .request import EmbeddingOutput, EmbeddingRequest

__all__ = ["EmbeddingOutput", "EmbeddingRequest", "PoolerConfig", "build_embedding_engine"]


def build_embedding_engine(config):
    """The engine of an embedding job: a strategy's own engine where it builds one (one
    handing the job to an installed vLLM runs its pooling runner), else the embedding engine."""
    own = config.strategy.build_engine(config) if config.strategy is not None else None
    if own is not None:
        return own
    from .engine import EmbeddingEngine

    return EmbeddingEngine.from_config(config)
