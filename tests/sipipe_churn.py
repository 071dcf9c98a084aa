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


def sample_columns(assigner, sampler, batch, rows: list, seqs: dict, logits, vocab: int):
    """One churn step through a replica's column sampler: `rows`' sequences joined to (or kept
    in) their columns, `logits` [rows, vocab] scattered to the columns, one sample. -> (each
    row's column, the sampler's tokens and logprobs by column)."""
    import torch

    from batchinfer.strategies.sipipe.columns import ColumnJoin

    def join_of(rid, col):
        s = seqs[rid]
        return ColumnJoin(col, rid, s.request.prompt_token_ids, list(s.output_token_ids),
                          s.request.sampling, s.request.sampling.seed,
                          s.request.bad_words_token_ids)

    cols, update = assigner.assign(batch, [len(s.output_token_ids) for s in rows], join_of)
    sampler.apply(update)
    logits_t = torch.empty(vocab, update.width)
    logits_t[:, cols] = logits.t()
    tokens, logprobs = sampler.sample(logits_t)
    return cols, tokens, logprobs


def pp2_and_single_process(make_engine, prompts: list, params: list) -> tuple[list, list]:
    """The same requests through SiPipe at PP=2 with its CPU samplers and through the single
    process (max_model_len 512, a 64 MiB cache). -> (SiPipe's outputs, the single process's)."""
    from batchinfer.strategies.sipipe.params import SiPipeParams

    model, cache = {"max_model_len": 512}, {"kv_cache_memory": "64MiB"}
    reference = make_engine(model=model, cache=cache).generate(prompts, params)
    strategy = SiPipeParams(policy="hb", chunk_size=16, max_num_batched_tokens=64)
    with make_engine(model=model, cache=cache, parallel={"pp": 2}, strategy=strategy,
                     scheduler=strategy.scheduler_config()) as eng:
        assert eng.info["sipipe"]["cpu_sampling"]
        return eng.generate(prompts, params), reference
