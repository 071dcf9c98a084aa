"""SiDP's side of a worker process: the shared FFN weights (Weight as a Service) and the compute
service (Compute as a Service).

After the model is built, the owners publish their FFN weights to the shared store and every
rank drops its own; the slots start reading only once every owner has written (a barrier over
all ranks); then, when asked, every rank measures the costs B_th is derived from. A plan with no
tokens is this replica's part of a CaS round it has no work for: it only serves the layers it
owns and sends its counters alone.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from batchinfer.engine.runtime.worker_extension import WorkerExtension

from .shared_ffn import SiDPWorkerSpec


@dataclass
class SiDPWorker(WorkerExtension):
    spec: SiDPWorkerSpec
    pack_linears: bool = False       # the attention's linears are packed once the FFN's are gone

    def setup(self, worker) -> dict:
        from batchinfer.engine.model.fast_linear import pack_linears
        from batchinfer.engine.runtime import transport

        from .cost_profile import profile_modes
        from .shared_ffn import install_shared_ffn

        self.shared_ffn = install_shared_ffn(worker.model, self.spec, worker.info.replica,
                                             worker.device, worker.spec.timeout_s, start=False)
        pack_linears(worker.model, weight_dtype=worker.model.linear_weight_dtype)
        if worker.device.type == "cuda":
            # the owners' rows are written before any replica reads them, and the FFN weights
            # each replica dropped go back to the GPU, which the others' KV caches share
            torch.cuda.synchronize(worker.device)
            torch.cuda.empty_cache()
        transport.barrier()
        self.shared_ffn.start()
        costs = (profile_modes(self.shared_ffn, self.spec.dp, worker.model.ops, worker.device)
                 if self.spec.profile_costs else None)
        return {"sidp_costs": costs}

    def execute(self, worker, plan, received) -> bool:
        if plan.num_tokens == 0:
            t0 = time.time()
            self.shared_ffn.serve(plan, worker.model.ops)
            worker.event("serve", plan.mb_id, t0)
            worker.send(("stats", worker.spec.rank, self.shared_ffn.stats()))
            return True
        self.shared_ffn.begin(plan)
        worker.execute_plain(plan, received)
        self.shared_ffn.end()
        return True

    def result_stats(self, worker) -> Optional[dict]:
        return self.shared_ffn.stats()

    def close(self, worker) -> None:
        self.shared_ffn.close()
