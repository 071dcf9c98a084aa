"""Strategies: each module registers its recipe parameters (engine/recipe.py's registry), which
build each replica's Scheduler and prepare the engine.

    baseline   engine/scheduler.py (SB / HB, vLLM-style virtual engines under PP)
    tdpipe     temporally-disaggregated pipeline parallelism (TD-Pipe)
    gllm       Token Throttling: balanced hybrid micro-batches under PP (gLLM)
    seesaw     PP prefill, TP decode, re-sharding at each switch, a CPU KV tier (Seesaw)
    sipipe     CPU sampling, token-safe execution, structure-aware transmission (SiPipe)
    sidp       data-parallel replicas sharing FFN weights: Weight as a Service (SiDP)
    vllm       the same job computed by an installed vLLM (a peer to compare against)
"""
from . import gllm, seesaw, sidp, sipipe, tdpipe, vllm_backend  # noqa: F401

__all__ = ["gllm", "seesaw", "sidp", "sipipe", "tdpipe", "vllm_backend"]
