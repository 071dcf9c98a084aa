"""How a job answers SIGTERM / SIGINT (Slurm time limits, scancel, preemption, Ctrl-C).

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
EXIT_SIGINT, EXIT_SIGTERM = 130, 143


class StopRequested(BaseException):
    """Raised by the handler during setup (a BaseException, so no `except Exception` on the way
    swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def signal_name(signum: Optional[int]) -> str:
    return signal.Signals(signum).name if signum is not None else "a signal"


def exit_code_for(signum: int) -> int:
    return EXIT_SIGINT if signum == signal.SIGINT else EXIT_SIGTERM


class StopSignals:
    def __init__(self):
        self.received: Optional[int] = None
        self.setting_up = True

    def install(self) -> Callable[[], None]:
        """Installs the handlers (main thread only); returns what restores the previous ones."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGXFSZ)
        previous = {sig: signal.getsignal(sig) for sig in handled}
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
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
