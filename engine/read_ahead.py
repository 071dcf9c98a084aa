"""Duplicate requests computed once, and prefix-grouped admission order: what the job runner
does with the requests it has read ahead, before the engine sees them.

Deduplication: a request whose prompt tokens and sampling parameters equal those of a request
already in the engine, with deterministic sampling (greedy, or a seed: the same tokens whatever
else runs), is not computed again; when the first one (the leader) finishes, each follower gets
the leader's result under its own id, metadata and line (an error record if the leader failed).
Unseeded sampling is never deduplicated: equal requests are meant to give different samples.

Grouping: the requests read in one go (at most io.max_in_flight) are handed to the engine sorted
by their prompt tokens. Lexicographic order is a depth-first walk of their token trie, so the
requests that share a prefix arrive together and the prefix stays in the cache for the group.
"""
from __future__ import annotations

import dataclasses
from typing import Hashable, Optional

from .request import Request, RequestOutput


def group_by_prefix(items: list, tokens_of) -> list:
    """`items` ordered so that shared token prefixes are adjacent (stable for equal prompts)."""
    return sorted(items, key=lambda item: tokens_of(item))


def dedup_key(request: Request) -> Optional[Hashable]:
    """What makes two requests' results interchangeable; None when they are not (unseeded
    sampling)."""
    sampling = request.sampling
    if sampling.temperature > 0 and sampling.seed is None:
        return None
    return tuple(request.prompt_token_ids), sampling.model_dump_json()


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
        """`request` went to the engine: equal requests read later follow it."""
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
        return [dataclasses.replace(out, request_id=f.request_id, payload=f.payload)
                for f in followers]

    def dropped(self) -> int:
        """Followers whose leader never finished (the job stopped): not written, run on resume."""
        return sum(len(f) for f in self._followers.values())
