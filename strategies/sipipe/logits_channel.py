"""The logits path from the last pipeline stage to the CPU samplers (the paper's BIC-L).

There are p logits slots per engine replica, float32 tensors in shared memory made by the
controller and mapped by the last stage's ranks and every sampler (torch shares them by file
descriptor: no shared-memory name that two runs could collide on). Micro-batch n's logits go to
slot n mod p: the last stage computes them transposed straight into the slot ([V, B], each
tensor-parallel rank its own vocabulary rows, columns in the order the controller chose: the
pool's shares side by side), then sends a few-byte descriptor to each sampler of the
micro-batch, which reads its own columns in place (sampler_pool.py). p slots are enough:
micro-batch n + p (the slot's next user) is only scheduled once the controller has all of
micro-batch n's tokens, which each sampler sends after it is done with the slot; `consumed`
(one entry per sampler state replica) records that hand-over and the producer checks it before
writing. On CUDA the logits cross to the slot asynchronously through pinned memory and a copy
stream, the descriptors following the copy (cuda_logits.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchinfer.engine.host_to_device import to_device

from .sampler_pool import PoolLayout


@dataclass
class SamplerLink:
    """What a last-stage rank holds of its replica's sampler pool."""

    pool: PoolLayout
    slots: list            # per residue mod p: float32 [vocab_size * columns], shared memory
    consumed: torch.Tensor  # int64 [pool.num_targets], shared: the last micro-batch each sampled
    conns: list            # per sampler: the write end of its logits pipe


def allocate_slots(pool: PoolLayout, vocab_size: int, columns: int):
    """pool.depth logits slots of vocab_size x columns, and the pool's `consumed` record."""
    import torch.multiprocessing  # noqa: F401  (registers the pickling of shared tensors)

    slots = [torch.zeros(vocab_size * columns, dtype=torch.float32).share_memory_()
             for _ in range(pool.depth)]
    consumed = torch.full((pool.num_targets,), -1, dtype=torch.long).share_memory_()
    return slots, consumed


def slot_view(slot: torch.Tensor, vocab_size: int, width: int) -> torch.Tensor:
    """The first vocab x width elements as a contiguous [V, width] matrix."""
    return slot[: vocab_size * width].view(vocab_size, width)


class LogitsProducer:
    """Last-stage side: writes a micro-batch's logits into its slot and tells its samplers."""

    def __init__(self, link: SamplerLink, vocab_size: int, tp_rank: int, on_error=None):
        """on_error: on CUDA, how the copier's sender thread reports a failure (cuda_logits.py)."""
        self.link, self.vocab_size, self.tp_rank = link, vocab_size, tp_rank
        self.on_error = on_error
        self.cuda = None        # on CUDA: cuda_logits.CudaLogitsCopier, made at the first forward

    def publish(self, model, plan, hidden, residual, logits_rows: torch.Tensor,
                forward_s: float) -> None:
        link, columns = self.link, plan.sample_columns
        shares = link.pool.shares_of(plan.mb_id)
        previous = plan.mb_id - link.pool.depth            # the slot's last user
        for sampler, replica in shares:
            if int(link.consumed[link.pool.target(sampler, replica)]) < previous:
                raise RuntimeError(f"sampler {sampler} has not released logits slot "
                                   f"{plan.mb_id % link.pool.depth} for micro-batch {previous}; "
                                   f"micro-batch {plan.mb_id} would overwrite logits still read")
        width, out, device_out = len(columns), None, None
        on_cuda = hidden is not None and hidden.device.type == "cuda"
        if width:
            by_column = torch.empty(width, dtype=torch.long, device=logits_rows.device)
            by_column[to_device(torch.tensor(columns), logits_rows.device)] = logits_rows
            start = model.shard.vocab_start
            out = slot_view(link.slots[plan.mb_id % link.pool.depth], self.vocab_size, width)
            out = out[start:start + model.shard.vocab_rows]
            target = out
            if on_cuda:     # on the GPU first; cuda_logits.py copies it over
                target = device_out = torch.empty(out.shape, dtype=out.dtype, device=hidden.device)
            model.compute_logits_columns(hidden[by_column],
                                         residual[by_column] if residual is not None else None,
                                         target)
        messages = [(link.conns[sampler], ("logits", plan.mb_id, self.tp_rank, forward_s))
                    for sampler, _ in shares]
        if on_cuda:
            if self.cuda is None:
                from .cuda_logits import CudaLogitsCopier

                self.cuda = CudaLogitsCopier(link.slots, hidden.device, self.on_error)
            self.cuda.publish(device_out, out, messages)
            return
        for conn, message in messages:
            conn.send(message)

    def close(self) -> None:
        if self.cuda is not None:
            self.cuda.close()
