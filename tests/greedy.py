"""Shared test helper: an engine's greedy continuations, batched or one prompt at a time."""
from __future__ import annotations

from batchinfer.engine.request import SamplingParams


def greedy_tokens(engine, prompts, batched: bool, max_new: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    if batched:
        return [o.output_token_ids for o in engine.generate(prompts, params)]
    return [engine.generate([p], params)[0].output_token_ids for p in prompts]
