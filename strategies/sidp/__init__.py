"""SiDP: data-parallel replicas that share FFN weights instead of each holding all of them. Layer
ownership with a peak-shifted prefetch order, the shared FFN store, per-rank weight slots with
their prefetch / housekeeper thread (Weight as a Service, §4.2), the compute service (Compute as a
Service, §4.3), the job orchestrator with its WaS/CaS mode switch and the startup profile B_th
comes from (params.py: the recipe section; build.py: the engine). On CUDA the replicas share one
GPU and its FFN store through CUDA IPC; owner buffers over several GPUs are not built."""
from . import params  # noqa: F401  (registers `sidp`)
