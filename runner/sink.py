"""Hands finished results to the writer in completion order, or held back into input order.

Every record the reader yields gets an admission number. In `input` order a result waits until
all earlier ones are written; the job's bound on pending records bounds what is held here too.
"""
from __future__ import annotations

from typing import Any, Callable


class OrderedSink:
    def __init__(self, order: str, write: Callable[[str, Any], None]):
        if order not in ("completion", "input"):
            raise ValueError(f"output_order must be completion or input, not {order!r}")
        self.order = order
        self._write = write
        self._admitted = 0
        self._next = 0
        self._held: dict[int, tuple[str, Any]] = {}
        self.written = 0

    def admit(self) -> int:
        """The next admission number."""
        number = self._admitted
        self._admitted += 1
        return number

    @property
    def pending(self) -> int:
        """Admitted but not yet written (in the engine, or held back for ordering)."""
        return self._admitted - self.written

    @property
    def held(self) -> int:
        return len(self._held)

    def submit(self, number: int, item: tuple[str, Any]) -> None:
        if self.order == "completion":
            self._write(*item)
            self.written += 1
            return
        self._held[number] = item
        while self._next in self._held:
            self._write(*self._held.pop(self._next))
            self._next += 1
            self.written += 1
