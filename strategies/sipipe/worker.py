"""SiPipe's side of a worker process: its switches, and on last-stage ranks with CPU sampling the
link to the replica's sampler processes (the last stage writes its logits rows there, transposed,
instead of sampling: logits_channel.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from batchinfer.engine.runtime.worker_extension import WorkerExtension

from .logits_channel import LogitsProducer, SamplerLink


@dataclass
class SiPipeWorker(WorkerExtension):
    token_safe_inputs: bool = True
    structure_aware: bool = True
    link: Optional[SamplerLink] = None   # last-stage ranks with CPU sampling only

    def roles(self, worker) -> None:
        if self.link is not None and worker.is_last:
            rank = worker.spec.rank
            worker.logits_out = LogitsProducer(
                self.link, worker.spec.vocab_size, worker.info.tp_rank,
                on_error=lambda detail: worker.send(("error", rank, detail)))
            worker.samples = False

    def close(self, worker) -> None:
        if isinstance(worker.logits_out, LogitsProducer):
            worker.logits_out.close()
