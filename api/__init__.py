"""batchinfer: an offline batch LLM job runner.

The Python API: build an Engine from an EngineConfig, add requests, step it, collect results.

    from batchinfer import Engine, EngineConfig, SamplingParams
    engine = Engine.from_config(EngineConfig())
    for out in engine.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0)):
        print(out.text)

With SamplingParams(n=4) each result is a ParallelOutput: `out.samples` holds the 4 replies.

Embeddings (model.task: embed; no path: the shipped all-MiniLM-L6-v2), as vLLM's LLM.embed:

    from batchinfer import EmbeddingEngine, EngineConfig
    with EmbeddingEngine.from_config(EngineConfig(model={"task": "embed"})) as engine:
        vectors = engine.embed(["Hello", "Bonjour"])      # one list of floats a text
"""
from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "batchinfer.engine.engine",
    "EngineConfig": "batchinfer.engine.config",
    "SamplingParams": "batchinfer.engine.request",
    "Request": "batchinfer.engine.request",
    "RequestOutput": "batchinfer.engine.request",
    "ParallelOutput": "batchinfer.engine.parallel_sampling",
    "EmbeddingEngine": "batchinfer.engine.embedding.engine",
    "EmbeddingRequest": "batchinfer.engine.embedding.request",
    "EmbeddingOutput": "batchinfer.engine.embedding.request",
}


def __getattr__(name: str) -> Any:
    # Lazy so that `batchinfer --version` and `validate` never import torch.
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(name)


__all__ = ["__version__", *_EXPORTS]
