"""SiDP in the simulator: data-parallel replicas that share FFN weights (strategies/sidp/), priced by a cost
model.

The real pieces run: the ownership map and each rank's prefetch order (strategies/sidp/ownership.py), the KV
sizing (strategies/sidp/build.py `sidp_num_blocks`), the mode switch (strategies/sidp/mode_switch.py) and the job
orchestrator's rounds (strategies/sidp/orchestrator.py; only its transport is replaced). What is priced:

- **WaS.** A replica's forward runs layer by layer; at a layer it does not own, the FFN needs the
  layer's weights in a slot. On a GPU a rank's reads run on their own link (copy engines,
  NVLink), in its prefetch order and across forward passes, each into a slot the forward has
  freed (the k-th read waits for the (k - slots)-th release), so they overlap compute until
  they cannot keep up. On a CPU no core is spare (the ranks' threads fill the host), so a read
  adds its copy time to the forward that uses it. Without peak shifting the d - 1 readers of a
  cycle read one owner at once: each read takes d - 1 times as long (DP=2: no effect, as in the
  engine). `weight_slots: false` (in place; unset, the default on a CPU, as in the engine): no
  copies on a CPU (shared host memory); on a GPU a remote FFN takes the longer of its GEMMs and
  streaming its weights from the peer.
- **CaS round.** The replicas start together (when the last one is free). Per layer each replica
  with work runs its attention (its layer time less the FFN's); a non-owner sends its FFN input
  to the owner (p2p, rows x hidden); the owner, once its own attention and the inputs are there,
  runs one GEMM chain over all rows (`gemm_fusion`; else one per replica) and returns each
  slice. A replica without work is a dummy: it only serves (`dummy_skipping`; without it, it
  brings one row to every layer).
- **B_th** (when `batch_threshold` is unset): mode_switch.profiled_threshold over the prices of
  one forward's FFN path in the tail, the quantity strategies/sidp/cost_profile.py measures, under its
  conditions (replica 0 alone: its reads overlap its compute, on a CPU too).
"""
from __future__ import annotations

from typing import Optional

from batchinfer.engine.engine import Replica
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.kv_groups import kv_capacity, make_block_manager
from batchinfer.engine.scheduler import MicroBatch
from .build import check_sidp_layout, resolve_weight_slots, sidp_num_blocks
from .cost_profile import BATCH_SIZES
from .mode_switch import ModeSwitch, profiled_threshold
from .orchestrator import Orchestrator
from .ownership import prefetch_order, resolve_owners, weight_slots

from batchinfer.sim.cost_model import BatchShape, CostModel, cost_device
from batchinfer.sim.executor import _EPS, SimulatedExecutor, VirtualClock, _InFlight
from batchinfer.sim.simulator import check_pool


class SlotReads:
    """One GPU rank's remote-FFN reads: its prefetch order, repeated every forward pass, into
    `slots` slots on a link of its own."""

    def __init__(self, order: list[int], slots: int, read_s: float):
        self.order, self.slots, self.read_s = order, slots, read_s
        self._position = {layer: i for i, layer in enumerate(order)}
        self._done: list[float] = []          # completion time of the k-th read
        self._released: list[float] = []      # time of the forward's k-th slot release
        self._link_free = 0.0

    def ready_at(self, layer: int, forward_pass: int) -> float:
        k = forward_pass * len(self.order) + self._position[layer]
        while len(self._done) <= k:
            j = len(self._done)
            start = self._link_free
            if j >= self.slots:
                if j - self.slots >= len(self._released):
                    raise RuntimeError("a weight read waits for a slot no forward has freed")
                start = max(start, self._released[j - self.slots])
            self._link_free = start + self.read_s
            self._done.append(self._link_free)
        return self._done[k]

    def release(self, t: float) -> None:
        self._released.append(t)


class _SimOrchestrator(Orchestrator):
    """The engine's orchestrator, sending plans into the simulated group instead of to workers."""

    def __init__(self, group: "SiDPGroup", dp: int, switch: ModeSwitch, dummy_skipping: bool,
                 clock: VirtualClock):
        super().__init__(None, dp, switch, dummy_skipping, clock)
        self.group = group

    def _send(self, replica: int, plan: MicroBatch) -> None:
        self.group.run_was(replica, plan)

    def _send_round_plans(self, plans: dict, rows: list[int]) -> None:
        self.group.run_round(plans, rows)


class SiDPSimExecutor(SimulatedExecutor):
    """One replica (one rank: tp 1, pp 1); its micro-batches go out through the orchestrator."""

    def __init__(self, group: "SiDPGroup", replica: int):
        super().__init__(group.clock, group.cost, [group.num_layers], 1, group.threads, replica)
        self.group = group
        self.free_at = 0.0
        self.forward_passes = 0

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight) + int(self.group.orchestrator.is_held(self.replica))

    @property
    def num_sent(self) -> int:
        return len(self._in_flight)

    def result_arrived(self) -> bool:
        return bool(self._in_flight) and self._in_flight[0].done_at <= self.clock.now + _EPS

    def submit(self, batch: MicroBatch) -> None:
        self.clock.advance(self.cost.controller_seconds(len(batch.items)))
        self.group.orchestrator.submit(self.replica, batch)

    def flush_submissions(self) -> None:
        self.group.orchestrator.flush()

    def wait(self) -> None:
        orchestrator = self.group.orchestrator
        if orchestrator.is_held(self.replica) and not orchestrator.waiting_on_others(self.replica):
            orchestrator.flush(force=True)
            return
        self.clock.advance_to_next_event()

    def record(self, batch: Optional[MicroBatch], start: float, end: float, busy: float,
               kind: str) -> None:
        """A forward (or a dummy's serving) from start to end, `busy` of it computing."""
        self.free_at = max(self.free_at, end)
        self._busy[0] += busy
        if batch is not None:
            self._micro_batches[0] += 1
            done = self._last_done = max(end, self._last_done)
            self._in_flight.append(_InFlight(batch, self._next_mb, done, busy, 0.0))
            self._next_mb += 1
        if self._window is None:
            self._window = [start, end]
        self._window[1] = max(self._window[1], end)
        if self.record_events:
            self.events.append({"replica": self.replica, "stage": 0, "rank": self.replica,
                                "kind": kind, "start": start, "end": end})

    def strategy_summary(self) -> dict:
        return self.group.summary()


class SiDPGroup:
    """The d replicas, their weight reads and the orchestrator, on one virtual clock."""

    def __init__(self, params, arch, cost: CostModel, clock: VirtualClock, dp: int, threads: int,
                 dtype_bytes: int):
        self.params, self.cost, self.clock = params, cost, clock
        self.dp, self.threads, self.num_layers = dp, threads, arch.num_layers
        try:
            self.owners = resolve_owners(params.owners, arch.num_layers, dp)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        # the shared FFN store and the rows sent to it are in the activations' dtype, as the
        # engine builds it (fp32 for a bf16 model on CPU: build.py's store_dtype); a cost model
        # knows that element (a measured table's activation_dtype_bytes), else the weights'
        act_bytes = int(getattr(cost, "dtype_bytes", dtype_bytes))
        self.layer_bytes = 3 * arch.hidden_size * arch.intermediate_size * act_bytes
        self.row_bytes = arch.hidden_size * act_bytes
        self.overlapped_reads = cost.device != "cpu"
        # a simulated CPU host is one memory
        self.with_slots = resolve_weight_slots(params.weight_slots, cost.device, nodes=1)
        incast = 1 if params.peak_shifting else max(dp - 1, 1)
        self.read_s = cost.weight_read_seconds(self.layer_bytes) * incast
        self.reads = [SlotReads(prefetch_order(r, self.owners, dp, params.peak_shifting),
                                weight_slots(r, self.owners, dp), self.read_s)
                      for r in range(dp)]
        self.weight_fetches = 0
        self.weight_wait_s = 0.0
        self.threshold = params.batch_threshold or self.priced_threshold()
        switch = ModeSwitch(self.threshold, params.mode_switch_patience,
                            params.mode_switch_hysteresis, enabled=params.compute_service)
        self.orchestrator = _SimOrchestrator(self, dp, switch, params.dummy_skipping, clock)
        self.executors = [SiDPSimExecutor(self, r) for r in range(dp)]
        self.orchestrator.executors = list(self.executors)

    # --- prices ---------------------------------------------------------------------------------
    def _layer_s(self, shape: BatchShape) -> float:
        return self.cost.stage_seconds(shape, 1, False, 1, self.threads)

    def _ffn_s(self, rows: int) -> float:
        return self.cost.ffn_seconds(rows, self.threads)

    def _head_s(self, shape: BatchShape) -> float:
        return self.cost.stage_seconds(shape, 0, True, 1, self.threads)

    def _rows_s(self, rows: int) -> float:
        return self.cost.p2p_seconds(rows * self.row_bytes)

    def _remote_ffn(self, layer: int, forward_pass: int, ready: float, ffn_s: float,
                    reads: Optional[SlotReads], overlapped: bool) -> tuple[float, float]:
        """A non-owned layer's FFN from time `ready` (attention done) -> (end, busy seconds)."""
        if not self.with_slots:
            if self.cost.device == "cpu":
                return ready + ffn_s, ffn_s                  # shared host memory, in place
            return ready + max(ffn_s, self.read_s), ffn_s   # streamed from the peer
        self.weight_fetches += 1
        if not overlapped:                                   # the copy runs on the rank's cores
            return ready + self.read_s + ffn_s, self.read_s + ffn_s
        weights_at = reads.ready_at(layer, forward_pass)
        self.weight_wait_s += max(weights_at - ready, 0.0)
        end = max(ready, weights_at) + ffn_s
        reads.release(end)
        return end, ffn_s

    def _was_forward(self, replica: int, start: float, attn_s: float, ffn_s: float,
                     forward_pass: int, reads: Optional[SlotReads],
                     overlapped: bool) -> tuple[float, float]:
        t, busy = start, 0.0
        for layer, owner in enumerate(self.owners):
            t += attn_s
            busy += attn_s
            if owner == replica:
                t += ffn_s
                busy += ffn_s
            else:
                t, spent = self._remote_ffn(layer, forward_pass, t, ffn_s, reads, overlapped)
                busy += spent
        return t, busy

    def priced_threshold(self) -> int:
        """B_th from the FFN path of one forward in the tail, in each mode, under the startup
        profile's conditions: replica 0 computes alone, so its reads overlap its compute on a
        CPU too (the idle replicas' cores copy)."""
        was_s, cas_s = {}, {}
        counted = self.weight_fetches, self.weight_wait_s
        for rows in BATCH_SIZES:
            ffn_s = self._ffn_s(rows)
            reads = SlotReads(self.reads[0].order, self.reads[0].slots, self.read_s)
            end0, _ = self._was_forward(0, 0.0, 0.0, ffn_s, 0, reads, True)   # slots filled
            end1, _ = self._was_forward(0, end0, 0.0, ffn_s, 1, reads, True)
            was_s[rows] = end1 - end0
            remote = sum(1 for owner in self.owners if owner != 0)
            cas_s[rows] = self.num_layers * ffn_s + remote * 2 * self._rows_s(rows)
        self.weight_fetches, self.weight_wait_s = counted
        return profiled_threshold(was_s, cas_s)

    # --- the two modes --------------------------------------------------------------------------
    def run_was(self, replica: int, batch: MicroBatch) -> None:
        executor = self.executors[replica]
        shape = BatchShape.of(batch)
        start = max(self.clock.now, executor.free_at)
        ffn_s = self._ffn_s(shape.tokens)
        inputs_at = start + self.cost.input_prep_seconds(shape)     # on the rank's thread
        end, busy = self._was_forward(replica, inputs_at, self._layer_s(shape) - ffn_s, ffn_s,
                                      executor.forward_passes, self.reads[replica],
                                      self.overlapped_reads)
        executor.forward_passes += 1
        head = self._head_s(shape)
        executor.record(batch, start, end + head, busy + head, "was")

    def run_round(self, plans: dict[int, MicroBatch], rows: list[int]) -> None:
        start = max([self.clock.now] + [e.free_at for e in self.executors])
        shapes = {r: BatchShape.of(batch) for r, batch in plans.items()}
        t = [start + (self.cost.input_prep_seconds(shapes[r]) if r in shapes else 0.0)
             for r in range(self.dp)]
        busy = [0.0] * self.dp
        attn = {r: self._layer_s(s) - self._ffn_s(s.tokens) for r, s in shapes.items()}
        for layer, owner in enumerate(self.owners):
            for r, seconds in attn.items():
                t[r] += seconds
                busy[r] += seconds
            senders = [r for r in range(self.dp) if r != owner and rows[r] > 0]
            owner_start = max([t[owner]] + [t[r] + self._rows_s(rows[r]) for r in senders])
            if self.params.gemm_fusion:
                ffn_s = self._ffn_s(sum(rows))
            else:
                ffn_s = sum(self._ffn_s(n) for n in rows if n > 0)
            t[owner] = owner_start + ffn_s
            busy[owner] += ffn_s
            for r in senders:
                t[r] = t[owner] + self._rows_s(rows[r])
        for r, executor in enumerate(self.executors):
            head = self._head_s(shapes[r]) if r in plans else 0.0
            executor.record(plans.get(r), start, t[r] + head, busy[r] + head,
                            "cas" if r in plans else "cas-dummy")

    def summary(self) -> dict:
        fetched = self.weight_fetches if self.with_slots else 0
        return {"weight_fetches": fetched, "weight_fetch_bytes": fetched * self.layer_bytes,
                "weight_wait_s": round(self.weight_wait_s, 6),
                "weight_reads_overlap_compute": self.overlapped_reads,
                **self.orchestrator.summary()}


def sidp_replicas(config, params, arch, cost: CostModel, clock: VirtualClock, layout,
                  dtype_bytes: int, max_model_len: int, threads: int,
                  plain_blocks: int, groups) -> tuple[list[Replica], dict]:
    """The replicas of a simulated SiDP engine, and the `sidp` part of its info (`groups`: the
    KV layer groups the engine runs, SimSetup.kv_groups)."""
    check_sidp_layout(config.parallel)
    group = SiDPGroup(params, arch, cost, clock, layout.dp, threads, dtype_bytes)
    num_blocks = sidp_num_blocks(config, layout, arch, cost_device(cost), dtype_bytes,
                                 group.owners, group.layer_bytes, group.with_slots,
                                 cost.memory_bytes, groups=groups)
    check_pool(config, layout, max_model_len, num_blocks, groups)
    replicas = []
    for executor in group.executors:
        block_manager = make_block_manager(groups, num_blocks, config.cache.block_size, False,
                                           config.cache.kv_window(arch))
        scheduler = params.make_scheduler(block_manager, max_model_len, layout.pp)
        replicas.append(Replica(scheduler, executor))
    block_size = config.cache.block_size
    info = {"owners": group.owners, "batch_threshold": group.threshold,
            "kv_tokens_per_replica": kv_capacity(groups, num_blocks, block_size,
                                                 max_model_len)[0],
            "plain_dp_kv_tokens_per_replica": kv_capacity(groups, plain_blocks, block_size,
                                                          max_model_len)[0],
            "kv_capacity_vs_plain_dp": round(num_blocks / plain_blocks, 3)
            if plain_blocks > 0 else None}
    return replicas, info
