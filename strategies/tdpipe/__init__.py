"""TD-Pipe: temporally-disaggregated pipeline parallelism (scheduler.py: the parameters and the
scheduler; policy.py: the phase-switch and work-stealing decisions)."""
from . import scheduler  # noqa: F401  (registers `tdpipe`)
