"""When the data-parallel group runs Weight as a Service and when Compute as a Service (§4.3).

The job orchestrator watches the effective batch size (the tokens the whole group runs in an
iteration: each replica's latest batch, 0 for one with no work) and switches every replica at once: to CaS once the
batch has stayed below the threshold B_th for `patience` consecutive iterations, back to WaS once
it has stayed at or above `hysteresis` x B_th as long. Pure Python over numbers: the same object
runs in the engine, in unit tests and in a simulator.

B_th comes from profiling (`profiled_threshold` over cost_profile.py's measurements): the
smallest batch at which a forward's FFN path under WaS (weight reads into slots plus the GEMMs) is
no slower than under CaS (the activations' round trips to the owners, who compute them). The
profile times the tail, one replica with all the rows, so B_th is a size of the group's batch: in
a CaS round every layer's owner runs one GEMM chain over every replica's rows, so what a round
costs follows the group's total, not the largest replica's share. (Switching on the largest share
sent 8 replicas of ~100 rows each into rounds that each ran 800-row FFNs layer after layer: 0.78x
WaS only, simulated on 8 x H20.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

WAS, CAS = "was", "cas"


@dataclass
class ModeSegment:
    """Consecutive iterations in one mode, with the range of effective batch sizes seen."""

    mode: str
    first: int
    last: int
    t_start: float
    t_end: float
    min_batch: int
    max_batch: int

    def as_dict(self) -> dict:
        return {"mode": self.mode, "iterations": [self.first, self.last],
                "t": [round(self.t_start, 3), round(self.t_end, 3)],
                "batch": [self.min_batch, self.max_batch]}


@dataclass
class ModeSwitch:
    threshold: int                 # B_th: below it (persistently) CaS, at or above it WaS
    patience: int = 16             # consecutive iterations past a bound before switching
    hysteresis: float = 1.5        # back to WaS only at >= hysteresis x B_th
    enabled: bool = True           # false: WaS only (the paper's "WaS only" of Fig. 13)
    mode: str = WAS
    iterations: dict = field(default_factory=lambda: {WAS: 0, CAS: 0})
    switches: int = 0
    segments: list = field(default_factory=list)
    _streak: int = 0

    def observe(self, effective_batch: int, now: float = 0.0) -> str:
        """One iteration's effective batch size; -> the mode for the next iterations."""
        self.iterations[self.mode] += 1
        self._record(effective_batch, now)
        if not self.enabled:
            return self.mode
        if self.mode == WAS:
            past = effective_batch < self.threshold
        else:
            past = effective_batch >= self.hysteresis * self.threshold
        self._streak = self._streak + 1 if past else 0
        if self._streak >= self.patience:
            self.mode = CAS if self.mode == WAS else WAS
            self.switches += 1
            self._streak = 0
        return self.mode

    def _record(self, batch: int, now: float) -> None:
        index = self.iterations[WAS] + self.iterations[CAS] - 1
        last: Optional[ModeSegment] = self.segments[-1] if self.segments else None
        if last is not None and last.mode == self.mode:
            last.last, last.t_end = index, now
            last.min_batch, last.max_batch = min(last.min_batch, batch), max(last.max_batch, batch)
        else:
            self.segments.append(ModeSegment(self.mode, index, index, now, now, batch, batch))

    def summary(self) -> dict:
        total = self.iterations[WAS] + self.iterations[CAS]
        return {"mode_threshold_b_th": self.threshold if self.enabled else None,
                "mode_switches": self.switches,
                "mode_iterations": dict(self.iterations),
                "cas_iteration_share": round(self.iterations[CAS] / total, 4) if total else None,
                "mode_timeline": [s.as_dict() for s in self.segments]}


def profiled_threshold(was_s: dict[int, float], cas_s: dict[int, float]) -> int:
    """B_th from the startup profile (cost_profile.py: one forward's FFN path in each mode, by
    batch rows): the smallest measured batch from which WaS is no slower than CaS; past the
    largest measured, that size doubled."""
    for rows in sorted(was_s):
        if was_s[rows] <= cas_s[rows]:
            return rows
    return 2 * max(was_s)
