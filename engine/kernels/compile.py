"""Compiles one kernel library into a staging directory: run as a child process by
batchinfer.engine.kernels, never imported.

    python compile.py '{"name": ..., "sources": [...], "include": ..., "cflags": [...],
                        "ldflags": [...], "build_dir": ..., "parent_pid": N}'

The parent starts this in a session of its own so it can stop the whole build (this process,
ninja, the compilers) on a signal or a timeout. If the parent dies first (even by kill -9), the
kernel sends this process SIGTERM, and it stops its session, so no orphaned compiler keeps
running.
"""
import ctypes
import json
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def _stop_session(signum, _frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        os.killpg(0, signal.SIGTERM)  # ninja passes it on to the compilers it runs
    finally:
        os._exit(128 + signum)


def main() -> None:
    args = json.loads(sys.argv[1])
    signal.signal(signal.SIGTERM, _stop_session)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != args["parent_pid"]:  # the parent died before the line above
        _stop_session(signal.SIGTERM, None)
    from torch.utils.cpp_extension import load

    load(name=args["name"], sources=args["sources"], extra_include_paths=[args["include"]],
         build_directory=args["build_dir"], extra_cflags=args["cflags"],
         extra_ldflags=args["ldflags"], is_python_module=False, verbose=True)


if __name__ == "__main__":
    main()
