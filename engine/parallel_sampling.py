"""Parallel sampling: a request with SamplingParams.n > 1 gets n samples of its reply, as vLLM's
(vllm/v1/engine/parallel_sampling.py).

Fan-out: the engine runs such a request as child requests, ordinary requests to the schedulers,
each with n = 1 and vLLM's id for it, f"{index}_{request id}". Where the request has a seed,
child i samples with seed + i (vLLM's rule: a seeded n = 3 request gives the replies of three
n = 1 requests seeded s, s + 1, s + 2); unseeded children each draw numbers of their own. Each
child stops on its own (EOS, stop strings, max_tokens). Greedy children would all give the same
reply, so one child is computed and its reply repeated n times (vLLM 0.32 refuses n > 1 at
temperature 0).

The prompt is computed once: the first child runs alone until its prompt's full blocks are
computed; then the others go to the head of the queue (Scheduler.add_next) starting from those
blocks, shared and reference counted, so each computes only the prompt's last partial block
before sampling its first token. With prefix caching on, the cache serves them the same blocks
(and with KV layer groups or sliding windows, where a table cannot be shared, only the cache
does). A scheduler whose KV moves between layouts (Scheduler.forks_prompt_blocks False) gets
every child at once, each computing the prompt.

Fan-in: the request finishes when its last child does, as one ParallelOutput holding the n
samples in index order. Its own text, token ids, finish reason and logprobs are the first
sample's; num_output_tokens counts every sample's tokens. A child that fails makes the request
fail, its error naming the sample.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from .request import FinishReason, Request, RequestOutput, SamplingParams, Sequence

_FAILED = (FinishReason.ERROR, FinishReason.ABORT)


def child_id(request_id: str, index: int) -> str:
    """vLLM's id of a request's child `index`."""
    return f"{index}_{request_id}"


def child_sampling(params: SamplingParams, index: int) -> SamplingParams:
    """Child `index`'s parameters: n = 1, and seed + index where the request has a seed. The
    prompt is scored once, by the first child (prompt_logprobs)."""
    update: dict = {"n": 1}
    if params.seed is not None:
        update["seed"] = params.seed + index
    if index and getattr(params, "prompt_logprobs", None) is not None:
        update["prompt_logprobs"] = None
    return params.model_copy(update=update)


@dataclass
class ParallelOutput(RequestOutput):
    """A finished request of n samples: `samples` in index order (each a child's result under
    its child id); the request's own reply fields are the first sample's."""

    samples: list[RequestOutput] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated for the request: every sample's."""
        return sum(sample.num_output_tokens for sample in self.samples)


def gather(request: Request, replies: list[RequestOutput], arrival_time: float) -> ParallelOutput:
    """The result of `request` (n samples) from its children's `replies` in index order: one
    reply of a greedy request stands for all n (also for an engine that gets n replies whole)."""
    n = request.sampling.n
    if len(replies) == 1 and n > 1:
        replies = [dataclasses.replace(replies[0], request_id=child_id(request.request_id, i))
                   for i in range(n)]
        preemptions = replies[0].num_preemptions
    else:
        preemptions = sum(reply.num_preemptions for reply in replies)
    first = replies[0]
    values = {f.name: getattr(first, f.name) for f in dataclasses.fields(RequestOutput)}
    starts = [r.first_token_time for r in replies if r.first_token_time is not None]
    ends = [r.finish_time for r in replies if r.finish_time is not None]
    values.update(request_id=request.request_id, payload=request.payload,
                  arrival_time=arrival_time, num_preemptions=preemptions,
                  first_token_time=min(starts, default=None), finish_time=max(ends, default=None),
                  copied_from=None)
    failed = next(((i, r) for i, r in enumerate(replies)
                   if r.error or r.finish_reason in _FAILED), None)
    if failed is not None:
        index, reply = failed
        values.update(finish_reason=reply.finish_reason, stop_reason=None,
                      error=reply.error and f"sample {index} of {n}: {reply.error}")
    return ParallelOutput(**values, samples=replies)


@dataclass(eq=False)
class _Parent:
    request: Request
    children: list[Sequence]          # computed children, index order (greedy: one)
    arrival_time: float
    share_tokens: int = 0             # the first child's prompt tokens the others start from
    held: list[Sequence] = field(default_factory=list)    # waiting for the first's prompt
    results: dict[int, RequestOutput] = field(default_factory=dict)


class ParallelSampling:
    """The engine's requests of n > 1 samples: their children, those held back, and the fan-in."""

    def __init__(self, engine):
        self.engine = engine
        self._parents: dict[str, _Parent] = {}
        # child id -> its request's state and its index there (no search of n children)
        self._parent_of: dict[str, tuple[_Parent, int]] = {}
        self._holding: dict[str, _Parent] = {}         # request id -> children held back
        self._forecasts_stale = False

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    @property
    def holding(self) -> bool:
        return bool(self._holding)

    def id_taken(self, request: Request) -> Optional[str]:
        """An id `request` (or one of its children) would take that a running request holds."""
        ids = [request.request_id]
        if request.sampling.n > 1:
            ids += [child_id(request.request_id, i) for i in range(self._computed(request))]
        running = self.engine._seqs
        return next((rid for rid in ids if rid in running or rid in self._parents), None)

    @staticmethod
    def _computed(request: Request) -> int:
        return 1 if request.sampling.greedy else request.sampling.n

    # --- fan-out --------------------------------------------------------------------------------
    def add(self, request: Request, replica: Optional[int]) -> None:
        engine = self.engine
        now = engine.now()
        rid = request.request_id
        children = [Sequence(request=dataclasses.replace(
            request, request_id=child_id(rid, i), sampling=child_sampling(request.sampling, i)),
            arrival_time=now) for i in range(self._computed(request))]
        parent = _Parent(request, children, now, share_tokens=self._share_tokens(request))
        self._parents[rid] = parent
        for index, seq in enumerate(children):
            self._parent_of[seq.request_id] = (parent, index)
        hold = parent.share_tokens > 0 and len(children) > 1
        for index, seq in enumerate(children):
            engine._register(seq)
            if index and hold:
                parent.held.append(seq)
            else:
                engine._place(seq, replica)
        if hold:
            self._holding[rid] = parent

    def _share_tokens(self, request: Request) -> int:
        """Prompt tokens the other children can take from the first one's blocks: its full
        blocks before the last prompt token (a query is never empty); 0 where none can."""
        scheduler = self.engine.replicas[0].scheduler
        bm = scheduler.block_manager
        if not scheduler.forks_prompt_blocks:
            return 0
        if bm.prefix is None and (bm.num_groups > 1 or bm.window):
            return 0          # no table to share; without the cache nothing gains by waiting
        return (len(request.prompt_token_ids) - 1) // bm.block_size * bm.block_size

    def release_ready(self) -> None:
        """Before each step: held children whose first child has its shared prompt computed
        go to the head of its replica's queue (and forecasts the runner updated reach them)."""
        if self._forecasts_stale:
            self._forecasts_stale = False
            for parent in self._parents.values():
                for seq in parent.children:
                    for name in ("predicted_output_len", "predicted_output_upper",
                                 "predicted_confidence"):
                        setattr(seq.request, name, getattr(parent.request, name))
        for parent in list(self._holding.values()):
            if parent.children[0].num_computed_tokens >= parent.share_tokens:
                self._release(parent)

    def _release(self, parent: _Parent) -> None:
        """The held children start: where the first child holds its prompt's blocks (and no
        prefix cache serves them), from those blocks; then at the head of its queue."""
        del self._holding[parent.request.request_id]
        lead = parent.children[0].request_id
        home = next((rep for rep in self.engine.replicas
                     if rep.scheduler.block_manager.block_table(lead)), None)
        if home is None:     # swapped out: the cache, if any, serves them from the queue
            for seq in parent.held:
                self.engine._place(seq, None)
            parent.held = []
            return
        bm = home.scheduler.block_manager
        shared = parent.share_tokens // bm.block_size
        blocks = bm.block_table(lead)[:shared] if bm.prefix is None else []
        for seq in reversed(parent.held):
            if len(blocks) == shared:
                bm.share(seq.request_id, blocks)
                seq.num_computed_tokens = parent.share_tokens
            home.scheduler.add_next(seq)
        parent.held = []

    def take_held(self) -> list[Sequence]:
        """Every held child (the engine aborts them)."""
        held = [seq for parent in self._holding.values() for seq in parent.held]
        for parent in self._holding.values():
            parent.held = []
        self._holding.clear()
        return held

    # --- fan-in ---------------------------------------------------------------------------------
    def finished(self, seq: Sequence, out: RequestOutput) -> Optional[RequestOutput]:
        """`seq` finished as `out` -> what the engine returns: `out` for a request of one
        sample; for a child, None until its request's last child finishes, then the request's
        ParallelOutput. A first child that finishes while others wait for its prompt lets them
        start first (its blocks are still held)."""
        entry = self._parent_of.pop(seq.request_id, None)
        if entry is None:
            return out
        parent, index = entry
        if index == 0 and parent.held and out.finish_reason is not FinishReason.ABORT:
            self._release(parent)
        parent.results[index] = out
        if len(parent.results) < len(parent.children):
            return None
        del self._parents[parent.request.request_id]
        return gather(parent.request, [parent.results[i] for i in range(len(parent.children))],
                      parent.arrival_time)

    def progress(self, seqs: dict[str, Sequence]) -> dict[str, int]:
        """Output tokens so far per unfinished request (a request of n samples: its longest)."""
        out: dict[str, int] = {}
        for rid, seq in seqs.items():
            entry = self._parent_of.get(rid)
            key = entry[0].request.request_id if entry is not None else rid
            out[key] = max(out.get(key, 0), len(seq.output_token_ids))
        self._forecasts_stale = True      # the caller may be about to change forecasts
        return out
