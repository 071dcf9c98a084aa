"""Async scheduling on one device: the next step is scheduled and launched while the GPU still
runs this one, as vLLM's async scheduling does, so the host's work per step (scheduling, input
preparation, output processing: ~20 us a sequence in Python) hides under the GPU's.

The sampled ids of a launched step stay on the device; the engine writes PENDING_TOKEN in their
place (`launched`) and the next step's plan takes them from the device (`StepPlan.pending`, the
executor's `substitute`). When the step's ids reach the host (`settle`) they replace the
placeholders and the stop conditions run: a sequence that stopped on EOS or a stop string was
already launched once more, and that step's token for it is dropped. A sequence whose length
limit is reached is known to finish and is not launched again.

The engine schedules ahead only while no step can preempt (free blocks cover every running
sequence's next block and a full token budget: a preempted sequence would be recomputed from
outputs not read yet) and no unfinished request uses penalties or bad words (the sampler reads
their token values). Otherwise the step waits for the previous one, as without async scheduling.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .executor import InProcessExecutor, StepResult, _row_logprobs
from .host_to_device import to_device
from .prompt_logprobs import score_slices
from .request import PENDING_TOKEN, RequestOutput, Sequence, SequenceStatus
from .scheduler import MicroBatch
from .step_plan import StepPlan, model_inputs, plan_batch


@dataclass
class _Launched:
    batch: MicroBatch
    sample_items: list[int]
    host_ids: Optional[torch.Tensor]      # the sampled ids, copied to the host without a wait
    done: Optional["torch.cuda.Event"]    # recorded after that copy (None on CPU)
    info: Optional[dict]                  # logprob tensors, read when collected
    t_start: float
    t_launched: float
    # a mixture of experts: (sparse layers, their tokens per expert copied to the host; read
    # when collected)
    expert_load: Optional[tuple[tuple[int, ...], torch.Tensor]] = None
    # scored prompt positions (prompt_logprobs.py: a request that asks waits for them here)
    prompt_logprobs: Optional[dict] = None


class AsyncInProcessExecutor(InProcessExecutor):
    """The single-device executor with up to two steps in flight: submit launches a step and
    returns before the GPU has run it; collect waits for its ids."""

    max_in_flight = 2

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._launched: deque[_Launched] = deque()
        self._last_sampled: Optional[torch.Tensor] = None

    @property
    def num_in_flight(self) -> int:
        return len(self._launched)

    def submit(self, batch: MicroBatch) -> None:
        self._launched.append(self._launch(batch))

    def ready(self) -> bool:
        head = self._launched[0]
        return head.done is None or head.done.query()

    def wait(self) -> None:
        head = self._launched[0]
        if head.done is not None:
            head.done.synchronize()

    def collect(self) -> tuple[MicroBatch, StepResult]:
        step = self._launched.popleft()
        if step.done is not None:
            step.done.synchronize()
        tokens: list[Optional[int]] = [None] * len(step.batch.items)
        logprobs: list[Optional[dict]] = [None] * len(step.batch.items)
        if step.sample_items:
            seqs = [step.batch.items[i].seq for i in step.sample_items]
            for row, (index, token) in enumerate(zip(step.sample_items, step.host_ids.tolist())):
                tokens[index] = token
                wanted = seqs[row].request.sampling.logprobs
                if step.info is not None and wanted is not None:
                    logprobs[index] = _row_logprobs(step.info, row, wanted)
        expert_load = None
        if step.expert_load is not None:
            layers, counts = step.expert_load
            expert_load = dict(zip(layers, counts.tolist()))
        return step.batch, StepResult(tokens, logprobs, forward_s=step.t_launched - step.t_start,
                                      sample_s=time.perf_counter() - step.t_launched,
                                      expert_load=expert_load,
                                      prompt_logprobs=step.prompt_logprobs)

    def close(self) -> None:
        self._launched.clear()
        super().close()

    @torch.inference_mode()
    def _launch(self, batch: MicroBatch) -> _Launched:
        t0 = time.perf_counter()
        plan = plan_batch(batch, self.block_manager)
        self.swap_area.run(plan.kv_swaps, self.kv_caches)
        substitute = self._substitution(plan)
        graphed = self.graphs.run(plan, substitute) if self.graphs is not None else None
        if graphed is not None:
            hidden, residual, rows = graphed
        else:
            inputs = model_inputs(plan, self.block_manager.block_size, self.device)
            if substitute is not None:
                substitute(inputs.input_ids)
            hidden, residual = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                          inputs.meta, self.backend)
            rows = inputs.logits_rows
        sampled = info = None
        self._last_sampled = None
        scores = (score_slices(self.model, hidden, residual, plan.prompt_scores)
                  if plan.prompt_scores else None)
        if plan.sample_items:
            seqs = [batch.items[i].seq for i in plan.sample_items]
            logits = self.model.compute_logits(hidden[rows],
                                               None if residual is None else residual[rows])
            sampled, info = self.sampler.sample(logits, self.sampler.prepare(seqs))
            self._last_sampled = sampled
        load = self.model.take_expert_load_on_device()
        host_ids, info, host_load, done = _to_host(sampled, info,
                                                   None if load is None else load[1])
        return _Launched(batch, plan.sample_items, host_ids, done, info, t0, time.perf_counter(),
                         None if load is None else (load[0], host_load), scores)

    def _substitution(self, plan: StepPlan) -> Optional[Callable[[torch.Tensor], None]]:
        """Writes the previous launch's sampled ids into this step's input ids, on the device."""
        if not plan.pending:
            return None
        previous = self._last_sampled
        assert previous is not None, "a pending token outlived the step that samples it"
        where = to_device(torch.tensor([p for p, _ in plan.pending], dtype=torch.long), self.device)
        rows = to_device(torch.tensor([r for _, r in plan.pending], dtype=torch.long), self.device)

        def substitute(input_ids: torch.Tensor) -> None:
            input_ids.index_copy_(0, where, previous.index_select(0, rows).to(input_ids.dtype))

        return substitute


def _to_host(ids: Optional[torch.Tensor], info: Optional[dict],
             expert_load: Optional[torch.Tensor] = None
             ) -> tuple[Optional[torch.Tensor], Optional[dict], Optional[torch.Tensor],
                        Optional["torch.cuda.Event"]]:
    """`ids` (and the rows' logprob tensors, when asked for; and a mixture of experts' tokens
    per expert) on the host without waiting: pinned copies and one event after them (CPU:
    themselves, no event). The collect reads them after the event, with no copy of its own."""
    tensors = [t for t in (ids, expert_load) if t is not None]
    if not tensors or tensors[0].device.type != "cuda":
        return ids, info, expert_load, None
    from .host_to_device import pinned

    def copy(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if tensor is None:
            return None
        host = pinned(torch.empty(tensor.shape, dtype=tensor.dtype))
        host.copy_(tensor, non_blocking=True)
        return host

    host_info = None if info is None else {name: copy(tensor) for name, tensor in info.items()}
    host_ids, host_load = copy(ids), copy(expert_load)
    done = torch.cuda.Event()
    done.record()
    return host_ids, host_info, host_load, done


class StepsAhead:
    """The engine's side: the placeholders of each launched step and their settling."""

    def __init__(self, engine):
        self.engine = engine
        self.penalised = 0                      # unfinished requests whose sampling reads tokens
        self.last_settled = 0.0                 # engine clock of the last step's return
        self._placeholders: dict[int, list[tuple[Sequence, int]]] = {}

    def may_launch_ahead(self, rep) -> bool:
        """True when the next step can't preempt and reads no token value still on the device
        (nor bring back swapped sequences, whose KV can take any number of blocks)."""
        scheduler = rep.scheduler
        if self.penalised or scheduler.num_swapped:
            return False
        bm = scheduler.block_manager
        budget_blocks = -(-scheduler.max_num_batched_tokens // bm.block_size)
        return bm.num_free_blocks >= bm.num_groups * (scheduler.num_running + budget_blocks + 1)

    def launched(self, batch: MicroBatch) -> None:
        """The step's effect as far as the host knows it: its tokens' KV computed, a placeholder
        for each sampled token. A sequence that reaches a length limit stays in flight (it
        finishes when its token arrives); the others may be scheduled again at once."""
        now = self.engine.now()
        counters = self.engine._counters
        max_model_len = self.engine.max_model_len
        placeholders = []
        row = 0
        for item in batch.items:
            seq = item.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            samples = seq.num_computed_tokens + item.num_tokens == seq.num_tokens
            if seq.num_computed_tokens < seq.prompt_len:
                counters["computed_prefill_tokens"] += item.num_tokens
            seq.num_computed_tokens += item.num_tokens
            if not samples:
                seq.in_flight = False
                continue
            placeholders.append((seq, len(seq.output_token_ids)))
            seq.output_token_ids.append(PENDING_TOKEN)
            seq.pending_row = row
            row += 1
            max_tokens = seq.request.sampling.max_tokens
            seq.in_flight = ((max_tokens is not None and len(seq.output_token_ids) >= max_tokens)
                             or seq.num_tokens >= max_model_len)
        self._placeholders[id(batch)] = placeholders

    def settle(self, batch: MicroBatch,
               result: StepResult) -> tuple[list[RequestOutput], MicroBatch]:
        """The step's ids are on the host: each replaces its placeholder, then the stop checks
        (a later placeholder of the same sequence is kept unless it stopped here). -> (finished
        requests, the batch less the sequences that had finished before it came back: the
        scheduler must not free them again, their id may name a new request by now)."""
        engine = self.engine
        now = engine.now()
        placeholders = iter(self._placeholders.pop(id(batch)))
        live = MicroBatch([item for item in batch.items if not item.seq.is_finished], batch.phase)
        done = []
        for token, logprob in zip(result.tokens, result.logprobs):
            if token is None:
                continue
            seq, index = next(placeholders)
            if seq.is_finished:        # stopped at the step before: this token is past its end
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            engine._counters["generation_tokens"] += 1
            later = seq.output_token_ids[index + 1:]
            del seq.output_token_ids[index:]
            if engine.outputs.append(seq, token, logprob):
                seq.finish_time = now
                seq.status = SequenceStatus.FINISHED
                engine._finish(seq, done)
            else:
                seq.output_token_ids.extend(later)
        return done, live

    def discard(self, batch: MicroBatch) -> None:
        """The step's results are dropped (abort): its placeholders and any after them go."""
        for seq, index in self._placeholders.pop(id(batch), []):
            if not seq.is_finished:
                del seq.output_token_ids[index:]
