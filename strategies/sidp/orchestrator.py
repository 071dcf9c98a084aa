"""SiDP's job orchestrator on the controller (§4.3): every iteration of every replica runs in one
mode, and CaS iterations run as rounds that all replicas join.

WaS: a replica's plan goes to its worker as soon as it is scheduled (replicas independent, as in
plain DP). CaS: plans wait until no replica has a plan outstanding, then go out together as one
round: each plan carries every replica's row count, and a replica with nothing scheduled gets a
dummy plan with no tokens (it only serves the layers it owns). Workers run plans in arrival order,
so every worker meets the rounds in the same order, whatever WaS plans came before: the ranks
agree on the communication of every layer and cannot deadlock. The mode changes between
iterations only, decided by ModeSwitch from the effective batch size.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from batchinfer.engine.step_plan import StepPlan

from .mode_switch import CAS, ModeSwitch


@dataclass
class RoundPlan(StepPlan):
    """A StepPlan in a CaS round: every replica's tokens in it (0: a dummy that brings none)."""

    cas_rows: list[int] = field(default_factory=list)


DUMMY_MB = -1


def dummy_plan(rows: list[int]) -> RoundPlan:
    return RoundPlan(DUMMY_MB, [], [], [], [], [], [], [], cas_rows=list(rows))


class Orchestrator:
    def __init__(self, pool, dp: int, switch: ModeSwitch, dummy_skipping: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        """pool: what plans go out through (the workers'); clock: the mode timeline's (the
        simulator's is virtual)."""
        self.pool, self.dp, self.switch = pool, dp, switch
        self.clock = clock
        self.dummy_skipping = dummy_skipping
        self.executors: list = [None] * dp            # replica -> its SiDPExecutor
        self._held: dict[int, StepPlan] = {}           # CaS plans waiting for their round
        self._sent_now: dict[int, int] = {}            # WaS plans sent since the last flush
        self._latest_rows = [0] * dp
        self.rounds = 0
        self._t0 = clock()

    @property
    def mode(self) -> str:
        return self.switch.mode

    # --- from the executors ---------------------------------------------------------------------
    def submit(self, replica: int, plan: StepPlan) -> None:
        if replica in self._held:   # its plans must reach it in the order they were made
            raise RuntimeError(f"replica {replica} scheduled again while its CaS plan waits for "
                               "its round")
        if self.switch.mode == CAS:
            self._held[replica] = plan
        else:
            self._send(replica, plan)
            self._sent_now[replica] = plan.num_tokens

    def is_held(self, replica: int) -> bool:
        return replica in self._held

    def flush(self, force: bool = False) -> None:
        """Once per engine step, after every replica was offered work: note the iteration's
        effective batch (WaS), or send a round when nothing is outstanding (CaS). force: send the
        held plans now, whoever is outstanding (draining)."""
        if self._sent_now:
            for replica in range(self.dp):
                if replica in self._sent_now:
                    self._latest_rows[replica] = self._sent_now[replica]
                elif not self.executors[replica].num_sent:
                    self._latest_rows[replica] = 0
            self._sent_now.clear()
            self._observe(sum(self._latest_rows))
        if self._held and (force or not any(e.num_sent for e in self.executors)):
            self._send_round()

    def waiting_on_others(self, replica: int) -> bool:
        """Whether `replica`'s held plan waits for another replica's outstanding result."""
        return replica in self._held and any(
            e.num_sent and not e.result_arrived() for e in self.executors)

    # --- rounds ---------------------------------------------------------------------------------
    def _send_round(self) -> None:
        real = [self._held[r].num_tokens if r in self._held else 0 for r in range(self.dp)]
        # without dummy skipping (the ablation) a dummy pushes one zero row through every layer
        rows = real if self.dummy_skipping else [n if n else 1 for n in real]
        self.rounds += 1
        plans, self._held = self._held, {}
        self._send_round_plans(plans, rows)
        self._latest_rows = real
        self._observe(sum(real))

    # --- transport (the simulator's orchestrator overrides these two) ---------------------------
    def _send(self, replica: int, plan: StepPlan) -> None:
        self.pool.send(replica, ("plan", plan))   # tp 1, pp 1: replica r is rank r
        self.executors[replica].mark_sent(plan.mb_id, isinstance(plan, RoundPlan))

    def _send_round_plans(self, plans: dict, rows: list[int]) -> None:
        """One CaS round: each replica's held plan, a dummy for the others."""
        for replica in range(self.dp):
            plan = plans.get(replica)
            if plan is None:
                self.pool.send(replica, ("plan", dummy_plan(rows)))
                continue
            self._send(replica, RoundPlan(**vars(plan), cas_rows=rows))

    def _observe(self, effective_batch: int) -> None:
        self.switch.observe(effective_batch, self.clock() - self._t0)

    def summary(self) -> dict:
        return {**self.switch.summary(), "cas_rounds": self.rounds}
