"""Shared fixtures: the embedded default model's converted directory and engine factories.

Engines are costly to build (weights, KV allocation), so tests share them per session and keep
KV budgets small.
"""
from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# engines built in this process must not pin its threads (tests/engine/test_cpu_binding.py pins
# in a child)
os.environ.setdefault("BATCHINFER_BIND_THREADS", "none")
os.environ.setdefault("BATCHINFER_CPU_BUSY_CHECK", "0")   # xdist's workers share the cores
# the many small engines here skip huge-page KV (it costs start time, pays back in long runs);
# tests/engine/test_kv_huge_pages.py turns it on
os.environ.setdefault("BATCHINFER_KV_HUGE_PAGES", "0")
# model.dtype auto is fp32 on every CPU here: the parity tests compare against transformers in
# fp32, and on a CPU with native bf16 auto may pick bf16 (tests of auto itself unset this)
os.environ.setdefault("BATCHINFER_CPU_AUTO_DTYPE", "float32")
logging.getLogger("batchinfer").setLevel(logging.WARNING)


ALL_CPUS_ENV = "TESTS_ALL_CPUS"      # the CPUs the suite started with, for tests that pin


def _own_cpus_per_xdist_worker() -> None:
    """Under pytest-xdist (`-n N`), worker i keeps only its own share of the CPUs. The engine
    sizes its threads from the CPUs a process may use (cpu_binding.allowed_cpus) and spawned
    workers inherit the mask, so N test processes do not each run as many OpenMP threads as the
    host has cores (oversubscribed OpenMP barriers crawl). With fewer CPUs than workers, worker
    i shares CPU i mod the count. A replacement for a crashed worker (a new id, gw2 and up)
    takes the share of its id mod N."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    try:
        count, index = int(count), int(worker.removeprefix("gw"))
    except ValueError:          # a worker id of another form: leave placement alone
        return
    cpus = sorted(os.sched_getaffinity(0))
    if count < 2 or not cpus:
        return
    index %= count
    lo, hi = len(cpus) * index // count, len(cpus) * (index + 1) // count
    mine = cpus[lo:hi] or [cpus[index % len(cpus)]]
    os.environ.setdefault(ALL_CPUS_ENV, ",".join(map(str, cpus)))
    os.sched_setaffinity(0, mine)
    os.environ.setdefault("OMP_NUM_THREADS", str(len(mine)))
    try:
        import torch

        torch.set_num_threads(len(mine))
    except ImportError:
        pass


_own_cpus_per_xdist_worker()


@pytest.fixture(scope="session")
def default_model_dir():
    from batchinfer.engine.model.sources import default_model_gguf, gguf_to_hf_dir

    return gguf_to_hf_dir(default_model_gguf())


@pytest.fixture(scope="session")
def make_engine():
    """make_engine(**sections) -> Engine; sections are EngineConfig fields as dicts."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine

    def build(**sections):
        sections.setdefault("cache", {"kv_cache_memory": "256MiB"})
        return Engine.from_config(EngineConfig(**sections))

    return build


TINY_LLAMA = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


@pytest.fixture(scope="session")
def tiny_engine_config():
    """A 2-layer dummy-weight model with the default tokenizer: fast enough for any test."""
    return {"model": {"load_format": "dummy", "hf_overrides": TINY_LLAMA, "max_model_len": 512},
            "cache": {"kv_cache_memory": "16MiB"}}
