"""The `vllm` strategy: the same job computed by an installed vLLM (params.py: the recipe section
and vLLM's arguments; engine.py: the engine adapter; worker.py: the vLLM subprocess)."""
from . import params  # noqa: F401  (registers `vllm`)
