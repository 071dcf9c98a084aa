"""How a job answers SIGTERM / SIGINT (Slurm time limits, scancel, preemption, Ctrl-C), and
SIGUSR1 / SIGHUP alike (Slurm's `--signal=USR1@<seconds>` warning before a time limit, a closed
terminal): each stops the job as SIGTERM does and exits 128 + its number.

During setup (run directory, kernel build, model load, worker start) nothing is written yet, so
the first signal stops setup where it is: the handler raises StopRequested. Once the job loop
runs, the first signal only sets `received`; the loop stops after its current step, so every
finished request is written and the rest run again on resume. A second signal exits at once
(every written line is already flushed). SIGXFSZ is ignored so that a file-size limit becomes an
error the run directory reports (EFBIG), not a silent kill.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable, Optional

log = logging.getLogger("batchinfer")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


class StopRequested(BaseException):
    """Raised by the handler during setup (a BaseException, so no `except Exception` on the way
    swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def signal_name(signum: Optional[int]) -> str:
    return signal.Signals(signum).name if signum is not None else "a signal"


def exit_code_for(signum: int) -> int:
    """128 + the signal's number, as a shell reports a process it ended (130 SIGINT, 143
    SIGTERM, 138 SIGUSR1, 129 SIGHUP)."""
    return 128 + int(signum)


class StopSignals:
    def __init__(self):
        self.received: Optional[int] = None
        self.setting_up = True

    def install(self) -> Callable[[], None]:
        """Installs the handlers (main thread only); returns what restores the previous ones."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        handled = (*STOP_SIGNALS, signal.SIGXFSZ)
        previous = {sig: signal.getsignal(sig) for sig in handled}
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

        def restore():
            for sig, old in previous.items():
                signal.signal(sig, old)
        return restore

    def _handle(self, signum, _frame) -> None:
        if self.received is not None:  # the second signal: leave now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum
        if self.setting_up:
            log.warning("%s received during setup: stopping now", signal_name(signum))
            raise StopRequested(signum)
        log.warning("%s received: stopping after the current step (send it again to exit at "
                    "once)", signal_name(signum))
