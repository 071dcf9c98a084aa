"""Strategies: each folder registers its recipe parameters (strategies/base.py's registry), which
build each replica's Scheduler and, where the strategy needs them, its own engine, executor,
worker extension and simulator model.

    baseline   engine/scheduler.py (SB / HB, vLLM-style virtual engines under PP)
    tdpipe     temporally-disaggregated pipeline parallelism (TD-Pipe)
    gllm       Token Throttling: balanced hybrid micro-batches under PP (gLLM)
    seesaw     PP prefill, TP decode, re-sharding at each switch, a CPU KV tier (Seesaw)
    sipipe     CPU sampling, token-safe execution, structure-aware transmission (SiPipe)
    sidp       data-parallel replicas sharing FFN weights: Weight as a Service (SiDP)
    vllm       the same job computed by an installed vLLM (a peer to compare against)

A new strategy: its folder, and one line below.
"""
from .base import STRATEGIES, BaselineStrategy, StrategyParams, register_strategy  # noqa: F401
from . import tdpipe  # noqa: F401,E402
from . import gllm  # noqa: F401,E402
from . import seesaw  # noqa: F401,E402
from . import sipipe  # noqa: F401,E402
from . import sidp  # noqa: F401,E402
from . import vllm  # noqa: F401,E402

__all__ = ["STRATEGIES", "BaselineStrategy", "StrategyParams", "register_strategy"]
