"""Imported once, by multiprocessing's fork server and nothing else (pool.py names it in the
server's preload list): the worker processes fork from a server that has torch and the worker
code imported already.

Spawning each worker from a fresh interpreter re-imported torch in every process, about 2 s of
CPU per worker on 2 cores, every time an engine started. The server starts with the first engine
of a process and serves every later one. It ignores SIGTERM as the workers do: Slurm's and a
terminal's signals reach the whole process group, the controller decides when to stop, and a
server that died of them would take its workers (PR_SET_PDEATHSIG) with it mid-stop. It exits
when the controller's process ends.
"""
import signal

import batchinfer.engine.runtime.worker  # noqa: F401  (torch and the worker code: the point)

for _sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
    signal.signal(_sig, signal.SIG_IGN)
