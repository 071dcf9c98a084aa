"""Which shard of the input this process owns when it runs as one task of `srun -n N`.

Only a job *step* (srun) shards: inside an sbatch script SLURM_NTASKS is set too, but only one
process runs there, and it must take the whole input. A step is recognised by SLURM_STEP_ID.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

from batchinfer.engine.errors import ConfigError
from .io.inputs import Shard


def detect_shard(env: Optional[Mapping[str, str]] = None) -> Shard:
    env = os.environ if env is None else env
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return Shard()
    count_text = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    try:
        index, count = int(env["SLURM_PROCID"]), int(count_text)
    except ValueError:
        raise ConfigError(f"SLURM_PROCID={env.get('SLURM_PROCID')!r} / SLURM_NTASKS={count_text!r} "
                          "are not integers") from None
    if count < 1 or not 0 <= index < count:
        raise ConfigError(f"SLURM_PROCID={index} is outside 0..{count - 1} (SLURM_NTASKS={count})")
    return Shard(index, count)


def parse_shard(text: str) -> Shard:
    """'I/N' (0-based task I of N) from the command line."""
    try:
        index_text, count_text = text.split("/")
        shard = Shard(int(index_text), int(count_text))
    except ValueError:
        raise ConfigError(f"--shard {text!r}: write it as I/N, e.g. 0/4") from None
    if shard.count < 1:
        raise ConfigError(f"--shard {text!r}: N, the number of shards, must be at least 1")
    if not 0 <= shard.index < shard.count:
        raise ConfigError(f"--shard {text!r}: I, this task's 0-based index, must be in "
                          f"0..{shard.count - 1}")
    return shard
