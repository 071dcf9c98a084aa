"""SiPipe: column-wise CPU sampling in sampler processes, the token-safe execution model and
structure-aware transmission, on the multi-process runtime (params.py: the recipe section)."""
from . import params  # noqa: F401  (registers `sipipe`)
