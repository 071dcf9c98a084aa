"""gLLM's Token Throttling (scheduler.py: the parameters, the budgets and the scheduler)."""
from . import scheduler  # noqa: F401  (registers `gllm`)
