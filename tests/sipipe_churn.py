"""The micro-batch churn the SiPipe sampler tests replay: PP=2 micro-batches whose sequences
join, leave, move to the other micro-batch and have their output trimmed (as the engine does on
a preemption), seeded, so every test of the column samplers sees the same history."""
from __future__ import annotations

import random
from typing import Iterator

from batchinfer.engine.request import Request, Sequence

# the token ids a request with bad_words bans (the engine tokenizes them when it admits one):
# 13 after 13, 17 after 99, and 5 alone
BAD_WORD_IDS = [[13, 13], [99, 17], [5]]


def churn(vocab: int, rng: random.Random, params: list, steps: int = 60, width: int = 9
          ) -> Iterator[tuple[int, int, list[str], list[Sequence], dict[str, Sequence]]]:
    """-> (step, micro-batch residue r, the batch's request ids in row order, its sequences,
    every sequence by id) for each step whose micro-batch is not empty. The caller appends the
    sampled tokens to the sequences before asking for the next step."""
    seqs: dict[str, Sequence] = {}
    members: list[list[str]] = [[], []]
    counter = 0
    for step in range(steps):
        r = step % 2
        batch = members[r]
        batch[:] = [rid for rid in batch if rng.random() > 0.15]            # leavers
        if batch and rng.random() < 0.1:                                     # one moves over
            members[1 - r].append(batch.pop(rng.randrange(len(batch))))
        while len(batch) < width and rng.random() < 0.6:                     # joiners
            counter += 1
            rid = f"r{counter}"
            sampling = params[counter % len(params)].model_copy(update={"seed": counter})
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
            bad = BAD_WORD_IDS if sampling.bad_words else None
            seqs[rid] = Sequence(request=Request(rid, prompt, sampling, bad_words_token_ids=bad))
            batch.append(rid)
        if not batch:
            continue
        for rid in batch:
            if seqs[rid].output_token_ids and rng.random() < 0.05:          # trimmed by the engine
                seqs[rid].output_token_ids.pop()
        rng.shuffle(batch)
        yield step, r, batch, [seqs[rid] for rid in batch], seqs
