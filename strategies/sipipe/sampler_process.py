"""A CPU sampler process of SiPipe's pool: its state replicas of the column-wise sampling state
(§5.1, §6).

It takes two inputs and joins them by micro-batch id: the controller's SamplerStep (which state
replica, which columns moved or joined, where its share lies in the logits slot; the paper's
BIC-I) and, from every tensor-parallel rank of the last stage, a descriptor saying its rows of
the logits are in the slot (BIC-L). It samples its share, marks its replica's slot use consumed and
sends the tokens (in column order) to the controller (its subslot of BIC-O). A separate process,
not a thread: sampling is CPU work that must not share the workers' interpreter lock.
"""
from __future__ import annotations

import os
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Optional

import torch

from .logits_channel import slot_view
from .sampler_pool import PoolLayout, SamplerStep


@dataclass
class SamplerSpec:
    rank: int                   # index in the controller's process pool (after the workers)
    replica: int                # engine replica whose micro-batches it samples
    index: int                  # which sampler of the replica's pool
    pool: PoolLayout
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple
    threads: int
    slots: list                 # shared float32 [vocab_size * columns], one per residue mod p
    consumed: torch.Tensor      # shared int64 [pool.num_targets]
    logits_conns: list          # read ends, one per tensor-parallel rank of the last stage
    store_port: int = 0         # unused (samplers join no process group); set by the pool
    tokenizer_source: Optional[str] = None   # the tokenizer's directory (structured_outputs)


def sampler_main(spec: SamplerSpec, conn) -> None:
    from batchinfer.engine.runtime.worker import run_child

    run_child(spec.rank, conn, lambda: SamplerProcess(spec, conn).run(),
              name=f"batchinfer-s{spec.replica}.{spec.index}")   # not a rank: replica.sampler


class SamplerProcess:
    def __init__(self, spec: SamplerSpec, conn):
        self.spec, self.conn = spec, conn
        self.steps: deque[SamplerStep] = deque()     # in micro-batch order
        self.arrived: dict[int, int] = defaultdict(int)
        self.forward_s: dict[int, float] = defaultdict(float)

    def run(self) -> None:
        from batchinfer.engine.kernels import load_native_kernels

        from .column_sampler import ColumnSampler

        spec = self.spec
        torch.set_num_threads(spec.threads)
        native = load_native_kernels()
        self.replicas = [ColumnSampler(spec.vocab_size, spec.pool.capacity, spec.max_model_len,
                                       spec.eos_token_ids, native_kernels=native,
                                       tokenizer_source=spec.tokenizer_source)
                         for _ in range(spec.pool.replicas)]
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
                            self.steps.append(message[1])
                        elif message[0] == "logits":
                            self.arrived[message[1]] += 1
                            self.forward_s[message[1]] = max(self.forward_s[message[1]],
                                                             message[3])
                while self.steps and self.arrived.get(self.steps[0].mb_id, 0) >= producers:
                    self._sample(self.steps.popleft())

    def _sample(self, step: SamplerStep) -> None:
        spec, update = self.spec, step.update
        start = time.time()
        sampler = self.replicas[step.replica]
        sampler.apply(update)
        tokens, logprobs = [], []
        if update.width:
            slot = slot_view(spec.slots[step.mb_id % spec.pool.depth], spec.vocab_size,
                             step.row_length)
            tokens, logprobs = sampler.sample(slot[:, step.offset:step.offset + update.width])
        spec.consumed[spec.pool.target(spec.index, step.replica)] = step.mb_id
        end = time.time()
        del self.arrived[step.mb_id]
        self.conn.send(("result", spec.replica, {
            "mb_id": step.mb_id, "offset": step.offset, "tokens": tokens, "logprobs": logprobs,
            "forward_s": self.forward_s.pop(step.mb_id, 0.0), "sample_s": end - start,
            "events": [{"rank": spec.rank, "replica": spec.replica, "stage": -1,
                        "tp_rank": 0, "kind": "sample", "mb": step.mb_id, "start": start,
                        "end": end, "columns": update.width}]}))
