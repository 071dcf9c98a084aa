"""Duplicate requests computed once, and prefix-grouped admission order: what the job runner
does with the requests it has read ahead, before the engine sees them.

Deduplication: a request whose prompt tokens, sampling parameters and LoRA adapter equal those
of a request already in the engine, with deterministic sampling (greedy, or a seed: the same
tokens whatever else runs), is not computed again; when the first one (the leader) finishes,
each follower gets the leader's result under its own id, metadata and line (an error record if
the leader failed).
Unseeded sampling is never deduplicated: equal requests are meant to give different samples.

Grouping: the runner reads up to io.group_window requests beyond those in the engine and holds
them in a PrefixWindow sorted by prompt tokens. Lexicographic order is a depth-first walk of
their token trie; the window hands requests to the engine as it has room, sweeping that order
like an elevator (the next request at or after the last one handed out, wrapping around), so the
requests that share a prefix arrive together and the prefix stays in the cache for the group,
and requests read later join the sweep where they belong.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Hashable, Optional

from batchinfer.engine.request import Request, RequestOutput


class PrefixWindow:
    """Read-ahead requests, handed out in token-trie order by a sweeping cursor."""

    def __init__(self):
        self._keys: list[tuple] = []       # sorted (prompt tokens, admission number)
        self._items: dict[tuple, object] = {}
        self._cursor: Optional[tuple] = None

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, tokens: list[int], order: int, item) -> None:
        key = (tuple(tokens), order)
        bisect.insort(self._keys, key)
        self._items[key] = item

    def pop(self):
        """The request after the last one handed out in trie order (the first when none is)."""
        index = 0 if self._cursor is None else bisect.bisect_right(self._keys, self._cursor)
        if index == len(self._keys):
            index = 0
        key = self._keys.pop(index)
        self._cursor = key
        return self._items.pop(key)

    def drain(self) -> list:
        """Everything still held (the job stops: these were never run)."""
        items = [self._items[key] for key in self._keys]
        self._keys.clear()
        self._items.clear()
        return items


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclasses.dataclass
class GroupingStats:
    """Prompt tokens each request shares with the request just before it, in the order read
    and in the order sent to the engine. With prefix caching a request can take what it shares
    with its predecessor from the cache (that prefix was just computed); the difference between
    the two orders estimates the prefill grouping avoids (the cache serves full blocks only,
    and may keep a prefix beyond its next use in either order)."""
    shared_tokens_read_order: int = 0
    shared_tokens_sent_order: int = 0
    _last_read: list = dataclasses.field(default_factory=list, repr=False)
    _last_sent: list = dataclasses.field(default_factory=list, repr=False)

    def on_read(self, tokens: list[int]) -> None:
        self.shared_tokens_read_order += common_prefix_len(self._last_read, tokens)
        self._last_read = tokens

    def on_sent(self, tokens: list[int]) -> None:
        self.shared_tokens_sent_order += common_prefix_len(self._last_sent, tokens)
        self._last_sent = tokens

    def as_dict(self) -> dict:
        return {"shared_tokens_read_order": self.shared_tokens_read_order,
                "shared_tokens_sent_order": self.shared_tokens_sent_order,
                "prefill_tokens_saved": max(0, self.shared_tokens_sent_order
                                            - self.shared_tokens_read_order)}


def dedup_key(request: Request) -> Optional[Hashable]:
    """What makes two requests' results interchangeable; None when they are not (unseeded
    sampling)."""
    if hasattr(request, "dedup_key"):      # an embedding request: its inputs and pooling
        return request.dedup_key()
    sampling = request.sampling
    if sampling.temperature > 0 and sampling.seed is None:
        return None
    # a LoRA adapter is part of the model that answers: equal prompts under two differ
    return tuple(request.prompt_token_ids), sampling.model_dump_json(), request.lora


@dataclasses.dataclass
class DedupStats:
    requests: int = 0               # followers answered from a leader's result
    prompt_tokens_saved: int = 0
    output_tokens_saved: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class Deduplicator:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.stats = DedupStats()
        self._leader_of: dict[Hashable, str] = {}          # key -> leader's request id
        self._followers: dict[str, list[Request]] = {}     # leader id -> its followers
        self._key_of: dict[str, Hashable] = {}

    def follow(self, request: Request) -> bool:
        """True when `request` waits for an equal one in the engine (do not submit it)."""
        if not self.enabled:
            return False
        key = dedup_key(request)
        leader = self._leader_of.get(key) if key is not None else None
        if leader is None:
            return False
        self._followers[leader].append(request)
        return True

    def lead(self, request: Request) -> None:
        """`request` will be computed (it went to the engine or waits in the prefix window):
        equal requests read later follow it."""
        if not self.enabled:
            return
        key = dedup_key(request)
        if key is not None and key not in self._leader_of:
            self._leader_of[key] = request.request_id
            self._followers[request.request_id] = []
            self._key_of[request.request_id] = key

    def abandon(self, request: Request) -> list[Request]:
        """The leader never ran (the engine refused it); -> its followers."""
        key = self._key_of.pop(request.request_id, None)
        if key is None:
            return []
        del self._leader_of[key]
        return self._followers.pop(request.request_id)

    def results_for(self, out: RequestOutput) -> list[RequestOutput]:
        """The leader `out` finished: one result per follower, under the follower's identity."""
        key = self._key_of.pop(out.request_id, None)
        if key is None:
            return []
        del self._leader_of[key]
        followers = self._followers.pop(out.request_id)
        for _ in followers:
            self.stats.requests += 1
            self.stats.prompt_tokens_saved += out.num_prompt_tokens
            self.stats.output_tokens_saved += out.num_output_tokens
        return [dataclasses.replace(out, request_id=f.request_id, payload=f.payload,
                                    copied_from=out.request_id) for f in followers]

    def dropped(self) -> int:
        """Followers whose leader never finished (the job stopped): not written, run on resume."""
        return sum(len(f) for f in self._followers.values())


class ReadAhead:
    """Between the tokenizer and the engine: a duplicate follows its leader; the others go to
    the engine, through the prefix window when grouping, while it holds < max_in_flight."""

    def __init__(self, io, max_in_flight: int, add: Callable[[object, Request], bool]):
        self.dedup = Deduplicator(io.dedup)
        self.window = PrefixWindow() if io.group_prefixes else None
        self.grouping = GroupingStats() if io.group_prefixes else None
        self.max_in_flight = max_in_flight
        self.read_limit = max_in_flight + (io.group_window if io.group_prefixes else 0)
        self.in_engine = 0               # given to the engine and not finished
        self._add = add                  # (spec, request) -> whether the engine took it

    def leaders(self, batch: list) -> list:
        """(spec, request) pairs in read order -> those to compute; each duplicate of one read
        earlier (or in flight) follows that leader instead."""
        kept = []
        for spec, request in batch:
            if not self.dedup.follow(request):
                self.dedup.lead(request)
                kept.append((spec, request))
        return kept

    def place(self, pairs: list) -> None:
        """Leaders (already predicted) -> the engine, or the window when grouping."""
        for spec, request in pairs:
            if self.window is None:
                self._submit(spec, request)
            else:
                self.grouping.on_read(request.prompt_token_ids)
                self.window.add(request.prompt_token_ids, request.payload.order, (spec, request))

    def feed(self) -> None:
        """Window -> engine in trie order while the engine holds fewer than max_in_flight."""
        while self.window and self.in_engine < self.max_in_flight:
            spec, request = self.window.pop()
            self.grouping.on_sent(request.prompt_token_ids)
            self._submit(spec, request)

    def _submit(self, spec, request: Request) -> None:
        if self._add(spec, request):
            self.in_engine += 1

    def finished(self, out: RequestOutput) -> list[RequestOutput]:
        """A request the engine finished -> the results of the duplicates that followed it."""
        self.in_engine -= 1
        return self.dedup.results_for(out)

    @property
    def waiting(self) -> int:
        """Requests read and held in the window, not yet given to the engine."""
        return len(self.window) if self.window else 0

    def drop(self) -> int:
        """The job stops: how many read requests were never computed (they run on resume)."""
        return self.dedup.dropped() + len(self.window.drain() if self.window else ())

    def summary(self) -> dict:
        out = {}
        if self.dedup.enabled:
            out["dedup"] = self.dedup.stats.as_dict()
        if self.grouping is not None:
            out["grouping"] = self.grouping.as_dict()
        return out
