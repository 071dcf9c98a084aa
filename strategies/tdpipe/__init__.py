"""TD-Pipe: temporally-disaggregated pipeline parallelism (params.py: the parameters;
scheduler.py: the scheduler; policy.py: the phase-switch and work-stealing decisions)."""
from . import scheduler  # noqa: F401  (registers `tdpipe`)
