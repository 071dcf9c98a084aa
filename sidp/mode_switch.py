"""When the data-parallel group runs Weight as a Service and when Compute as a Service (§4.3).

The job orchestrator watches the effective batch size (the most tokens any replica runs in an
iteration; a replica with no work counts 0) and switches every replica at once: to CaS once the
batch has stayed below the threshold B_th for `patience` consecutive iterations, back to WaS once
it has stayed at or above `hysteresis` x B_th as long. Pure Python over numbers: the same object
runs in the engine, in unit tests and in a simulator.

B_th comes from profiling (`profiled_threshold`): the smallest batch at which WaS's layer time
(the FFN GEMM plus whatever part of the weight fetch the forward does not hide) is no more than
CaS's (the owner's fused GEMM over every replica's rows, plus the activations' round trip).
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
        return {"mode_threshold_b_th": self.threshold, "mode_switches": self.switches,
                "mode_iterations": dict(self.iterations),
                "cas_iteration_share": round(self.iterations[CAS] / total, 4) if total else None,
                "mode_timeline": [s.as_dict() for s in self.segments]}


def profiled_threshold(ffn_s: dict[int, float], fetch_s: float, p2p_s: float, dp: int,
                       fetch_hidden: bool) -> int:
    """B_th from measured costs: ffn_s (batch rows -> one layer's FFN time), fetch_s (one layer's
    weights read into a slot), p2p_s (one activation transfer between replicas). fetch_hidden: the
    read runs on its own engine (a GPU's copy engine) and overlaps the forward; on a CPU it takes
    the same cores and memory, so WaS pays it in full. -> the smallest measured batch from which
    on WaS is no slower per layer; past the largest measured, that size doubled."""
    sizes = sorted(ffn_s)
    remote_share = (dp - 1) / dp

    def ffn(rows: int) -> float:        # linear between measured sizes, proportional past them
        if rows <= sizes[0]:
            return ffn_s[sizes[0]]
        for low, high in zip(sizes, sizes[1:]):
            if rows <= high:
                frac = (rows - low) / (high - low)
                return ffn_s[low] + frac * (ffn_s[high] - ffn_s[low])
        return ffn_s[sizes[-1]] * rows / sizes[-1]

    for rows in sizes:
        unhidden = max(0.0, fetch_s - ffn(rows)) if fetch_hidden else fetch_s
        was = ffn(rows) + remote_share * unhidden
        cas = ffn(dp * rows) + remote_share * 2 * p2p_s
        if was <= cas:
            return rows
    return 2 * sizes[-1]
