"""The KV cache's totals over the replicas' block managers, for Engine.stats."""
from __future__ import annotations


def swap_stats(managers: list) -> dict:
    """The swap areas' totals over the replicas (memory.preemption_mode: swap)."""
    areas = [bm.swap.summary() for bm in managers if bm.swap is not None]
    if not areas:
        return {}
    return {"kv_swap": {key: sum(area[key] for area in areas) for key in areas[0]}}


def prefix_cache_stats(managers: list) -> dict:
    """Tokens of admitted sequences and how many of them came from the prefix cache."""
    caching = [bm for bm in managers if bm.prefix is not None]
    if not caching:
        return {}
    queried = sum(bm.prefix_queried_tokens for bm in caching)
    hit = sum(bm.prefix_hit_tokens for bm in caching)
    return {"prefix_cache": {"queried_tokens": queried, "hit_tokens": hit,
                             "hit_rate": round(hit / queried, 4) if queried else None}}
