"""A CPU sampler process: one replica of the column-wise sampling state (§5.1, §6).

It takes two inputs and joins them by micro-batch id: the controller's step (which columns moved
or joined; the paper's BIC-I) and, from every tensor-parallel rank of the last stage, a
descriptor saying its rows of the logits are in the slot (BIC-L). It samples, marks the slot
consumed and sends the tokens (in column order) to the controller (BIC-O). A separate process,
not a thread: sampling is CPU work that must not share the workers' interpreter lock.
"""
from __future__ import annotations

import os
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch

from .logits_channel import slot_view


@dataclass
class SamplerSpec:
    rank: int                   # index in the controller's process pool (after the workers)
    replica: int                # engine replica whose micro-batches it samples
    index: int                  # which of the replica's samplers (micro-batch id mod count)
    vocab_size: int
    capacity: int               # columns: most sequences sampled in one micro-batch
    max_model_len: int
    eos_token_ids: tuple
    threads: int
    slot: torch.Tensor          # shared float32 [vocab_size * capacity]
    consumed: torch.Tensor      # shared int64 [samplers of the replica]
    logits_conns: list          # read ends, one per tensor-parallel rank of the last stage
    store_port: int = 0         # unused (samplers join no process group); set by the pool


def sampler_main(spec: SamplerSpec, conn) -> None:
    from batchinfer.engine.runtime.worker import run_child

    run_child(spec.rank, conn, lambda: SamplerProcess(spec, conn).run())


class SamplerProcess:
    def __init__(self, spec: SamplerSpec, conn):
        self.spec, self.conn = spec, conn
        self.steps: deque = deque()                  # (mb_id, ColumnUpdate) in order
        self.arrived: dict[int, int] = defaultdict(int)
        self.forward_s: dict[int, float] = defaultdict(float)

    def run(self) -> None:
        from batchinfer.engine.kernels import load_native_kernels

        from .column_sampler import ColumnSampler

        spec = self.spec
        torch.set_num_threads(spec.threads)
        self.sampler = ColumnSampler(spec.vocab_size, spec.capacity, spec.max_model_len,
                                     spec.eos_token_ids, native_kernels=load_native_kernels())
        self.conn.send(("ready", spec.rank, {"pid": os.getpid(), "sampler": spec.index}))
        producers = len(spec.logits_conns)
        with torch.inference_mode():
            while True:
                for ready in wait([self.conn] + list(spec.logits_conns)):
                    while ready.poll():
                        message = ready.recv()
                        if message[0] == "stop":
                            return
                        if message[0] == "step":
                            self.steps.append((message[1], message[2]))
                        elif message[0] == "logits":
                            self.arrived[message[1]] += 1
                            self.forward_s[message[1]] = max(self.forward_s[message[1]],
                                                             message[3])
                while self.steps and self.arrived.get(self.steps[0][0], 0) >= producers:
                    self._sample(*self.steps.popleft())

    def _sample(self, mb_id: int, update) -> None:
        spec = self.spec
        start = time.time()
        self.sampler.apply(update)
        tokens, logprobs = [], []
        if update.width:
            logits_t = slot_view(spec.slot, spec.vocab_size, update.width)
            tokens, logprobs = self.sampler.sample(logits_t)
        spec.consumed[spec.index] = mb_id
        end = time.time()
        del self.arrived[mb_id]
        self.conn.send(("result", spec.replica, {
            "mb_id": mb_id, "tokens": tokens, "logprobs": logprobs,
            "forward_s": self.forward_s.pop(mb_id, 0.0), "sample_s": end - start,
            "events": [{"rank": spec.rank, "replica": spec.replica, "stage": -1,
                        "tp_rank": 0, "kind": "sample", "mb": mb_id, "start": start,
                        "end": end, "columns": update.width}]}))
