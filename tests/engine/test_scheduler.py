"""The SB and HB baselines on hand-made states (pure Python: no model involved)."""
from __future__ import annotations

from batchinfer.engine.kv_cache import BlockManager
from batchinfer.engine.request import Request, SamplingParams, Sequence, SequenceStatus
from batchinfer.engine.batching_policies import HybridBatching, SeparateBatching


def seq(rid, prompt_len, max_tokens=8):
    return Sequence(Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens)))


def run_step(sched, token=7):
    """What the engine does after executing: advance computed counts, append sampled tokens.
    Each batch gets `counts` (prefill, decode tokens), read before the step is applied."""
    batches = sched.schedule()
    for batch in batches:
        batch.counts = (batch.num_prefill_tokens, batch.num_decode_tokens)
        for item in batch.items:
            samples = item.samples
            item.seq.num_computed_tokens += item.num_tokens
            if samples:
                item.seq.output_token_ids.append(token)
                if len(item.seq.output_token_ids) >= item.seq.request.sampling.max_tokens:
                    item.seq.status = SequenceStatus.FINISHED
        sched.on_result(batch)
    return batches


def test_sb_prefills_whole_prompts_first_then_decodes():
    sched = SeparateBatching(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=20,
                             max_model_len=64)
    for i, n in enumerate([8, 8, 8]):
        sched.add(seq(f"s{i}", n))
    first = run_step(sched)[0]
    assert first.phase == "prefill" and [i.num_tokens for i in first.items] == [8, 8]
    second = run_step(sched)[0]
    assert second.phase == "prefill" and [i.seq.request_id for i in second.items] == ["s2"]
    third = run_step(sched)[0]
    assert third.phase == "decode" and len(third.items) == 3 and third.num_tokens == 3


def test_hb_mixes_decodes_and_prefill_chunks_under_budget():
    sched = HybridBatching(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10,
                           max_model_len=64, chunk_size=6)
    sched.add(seq("a", 4))
    sched.add(seq("b", 15))
    first = run_step(sched)[0]
    assert first.counts == (10, 0)
    assert [(i.seq.request_id, i.num_tokens) for i in first.items] == [("a", 4), ("b", 6)]
    second = run_step(sched)[0]  # a decodes (1), b continues its prompt (6), budget 10
    assert second.counts == (6, 1)
    assert [(i.seq.request_id, i.num_tokens) for i in second.items] == [("a", 1), ("b", 6)]
    assert second.phase == "mixed"
    third = run_step(sched)[0]
    assert [(i.seq.request_id, i.num_tokens) for i in third.items] == [("a", 1), ("b", 3)]
    assert third.items[1].seq.output_token_ids == [7]  # the last chunk samples


def test_preemption_by_recompute_when_blocks_run_out():
    bm = BlockManager(6, 4)  # 24 tokens in all
    sched = HybridBatching(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    for i in range(3):
        sched.add(seq(f"s{i}", 7, max_tokens=12))
    steps = 0
    while sched.has_unfinished():
        run_step(sched)
        bm.check_invariants()
        steps += 1
        assert steps < 200
    assert sched.num_preemptions > 0
    assert bm.num_free_blocks == bm.num_blocks


def test_an_idle_cache_admits_past_the_watermark():
    bm = BlockManager(10, 4, watermark=0.5)
    sched = SeparateBatching(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    sched.add(seq("big", 36))  # needs 9 of 10 blocks: above the watermark, but nothing runs
    assert run_step(sched)[0].items[0].num_tokens == 36
