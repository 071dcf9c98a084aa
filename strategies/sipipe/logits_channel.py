"""The logits path from the last pipeline stage to the CPU samplers (the paper's BIC-L).

Each sampler replica has one logits slot: a float32 tensor in shared memory, made by the
controller and mapped by the last stage's ranks and the sampler (torch shares it by file
descriptor: no shared-memory name that two runs could collide on). The last stage computes the
logits transposed straight into the slot, each tensor-parallel rank its own vocabulary rows, in
the sampler's column order, then sends a few-byte descriptor down a pipe. One slot per replica is
enough: micro-batch n + p (the slot's next user) is only scheduled once the controller has
micro-batch n's tokens, which the sampler sends after it is done with the slot; `consumed` records
that hand-over and the producer checks it before writing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplerLink:
    """What a last-stage rank holds of its replica's samplers."""

    slots: list            # per sampler: float32 [vocab_size * capacity], shared memory
    consumed: torch.Tensor  # int64 [num_samplers], shared: the last micro-batch each sampled
    conns: list            # per sampler: the write end of its logits pipe


def allocate_slots(num_samplers: int, vocab_size: int, capacity: int):
    import torch.multiprocessing  # noqa: F401  (registers the pickling of shared tensors)

    slots = [torch.zeros(vocab_size * capacity, dtype=torch.float32).share_memory_()
             for _ in range(num_samplers)]
    consumed = torch.full((num_samplers,), -1, dtype=torch.long).share_memory_()
    return slots, consumed


def slot_view(slot: torch.Tensor, vocab_size: int, width: int) -> torch.Tensor:
    """The first vocab x width elements as a contiguous [V, width] matrix."""
    return slot[: vocab_size * width].view(vocab_size, width)


class LogitsProducer:
    """Last-stage side: writes a micro-batch's logits into its sampler's slot and tells it."""

    def __init__(self, link: SamplerLink, vocab_size: int, tp_rank: int):
        self.link, self.vocab_size, self.tp_rank = link, vocab_size, tp_rank

    def publish(self, model, plan, hidden, residual, logits_rows: torch.Tensor,
                forward_s: float) -> None:
        sampler, columns = plan.sampler, plan.sample_columns
        num = len(self.link.slots)
        if int(self.link.consumed[sampler]) < plan.mb_id - num:
            raise RuntimeError(f"sampler {sampler} has not released its logits slot for "
                               f"micro-batch {plan.mb_id - num}; micro-batch {plan.mb_id} "
                               "would overwrite logits still being read")
        width = len(columns)
        if width:
            by_column = torch.empty(width, dtype=torch.long, device=logits_rows.device)
            by_column[torch.tensor(columns, device=logits_rows.device)] = logits_rows
            start = model.shard.vocab_start
            out = slot_view(self.link.slots[sampler], self.vocab_size, width)
            out = out[start:start + model.shard.vocab_rows]
            model.compute_logits_columns(hidden[by_column],
                                         residual[by_column] if residual is not None else None,
                                         out)
        self.link.conns[sampler].send(("logits", plan.mb_id, self.tp_rank, forward_s))
