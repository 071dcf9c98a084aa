"""Seesaw: PP prefill, TP decode, re-sharding at each switch, a CPU KV tier (params.py: the
recipe section; scheduler.py; executor.py; build.py: the engine; worker.py: the worker extension;
sim.py: the simulator model). The machinery it drives is resharding/."""
from . import params  # noqa: F401  (registers `seesaw`)
