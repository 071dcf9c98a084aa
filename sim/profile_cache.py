"""This machine's profile of a model (sim/profiler.py), measured once and kept in the setup cache,
for the runs that resolve an `auto` setting by simulation (sim/auto_settings.py).

The profile is `batchinfer profile`'s, at the one thread count a rank of the run gets (the
layouts an `auto` chooses between all use the same ranks). The entry's key is what the numbers
depend on: the model and device sections, the KV cache's block size and dtype, the all-reduce,
that thread count, the CPU (model and flags), the GPU's name and the torch version; another
machine or model never reads it. The first run pays for the profile (minutes on a CPU host,
logged); a concurrent one waits for it (setup_cache.build_once).
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

from batchinfer.engine.config import EngineConfig

log = logging.getLogger("batchinfer")

TABLE_FILE = "profile_table.json"
PROFILE_WAIT_S = 3600.0      # another run profiling the same machine: wait this long at most
PROGRESS_EVERY_S = 15.0      # a progress line at most this often while profiling


def rank_threads(config: EngineConfig) -> int:
    """The CPU threads each rank of `config`'s parallel layout runs with."""
    from batchinfer.engine.runtime.layout import threads_per_rank

    par = config.parallel
    return threads_per_rank(par, par.tp * par.pp * par.dp, config.device.num_threads)


def profile_key(config: EngineConfig) -> str:
    import torch

    from batchinfer.engine.host_cpu import cpu_identity

    cpu, flags = cpu_identity()
    gpu = (torch.cuda.get_device_name(0)
           if config.device.device != "cpu" and torch.cuda.is_available() else None)
    return json.dumps({"model": config.model.model_dump(mode="json"),
                       "device": config.device.model_dump(mode="json"),
                       "block_size": config.cache.block_size,
                       "kv_cache_dtype": config.cache.kv_cache_dtype,
                       "tp_all_reduce": config.parallel.tp_all_reduce,
                       "threads": rank_threads(config),
                       "cpu": cpu, "flags": sorted(flags), "gpu": gpu,
                       "torch": torch.__version__}, sort_keys=True)


def entry_dir(config: EngineConfig) -> Path:
    from batchinfer.engine.setup_cache import cache_root

    digest = hashlib.sha256(profile_key(config).encode()).hexdigest()[:20]
    return cache_root() / "profiles" / f"profile-{digest}"


def cached_profile(config: EngineConfig) -> Path:
    """The path of this machine's profile table for `config`'s model, profiled now if no run
    has done it yet."""
    from batchinfer.engine.setup_cache import build_once, timeout_scale

    from .profiler import profile_machine

    def measure_into(staging: Path) -> None:
        log.info("profiling this machine for the model once (minutes); later runs with the same "
                 "model and device settings reuse it (%s)", target)
        table = profile_machine(config, threads=[rank_threads(config)], progress=_LogProgress())
        table.save(staging / TABLE_FILE)
        (staging / "key.json").write_text(profile_key(config))

    target = entry_dir(config)
    target.parent.mkdir(parents=True, exist_ok=True)
    entry = build_once(target, measure_into, what="profiling this machine",
                       wait_timeout_s=PROFILE_WAIT_S * timeout_scale(),
                       is_complete=lambda path: (path / TABLE_FILE).is_file())
    return entry / TABLE_FILE


class _LogProgress:
    """The profiler's progress as a log line every PROGRESS_EVERY_S at most."""

    def __init__(self):
        self._last = time.monotonic()

    def __call__(self, message: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self._last >= PROGRESS_EVERY_S:
            self._last = now
            log.info("profiling: %s (%d of %d steps)", message, done, total)
