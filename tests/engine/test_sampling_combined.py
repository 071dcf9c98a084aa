"""n > 1 samples under swap preemption (the tiny dummy-weight model): the first sample swapped
out while the others are still held for its prompt blocks; every sample still gives its n = 1
request's reply and every block comes back."""
from __future__ import annotations

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.parallel_sampling import child_id
from batchinfer.engine.request import Request, SamplingParams
from tests.conftest import TINY_LLAMA

PROMPT = list(range(100, 170))        # 70 tokens: four full blocks, then a partial one
PARAMS = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=8, ignore_eos=True)


def _config(**cache) -> EngineConfig:
    return EngineConfig(model={"load_format": "dummy", "hf_overrides": TINY_LLAMA,
                               "max_model_len": 128},
                        cache={"kv_cache_memory": "16MiB", **cache},
                        scheduler={"policy": "hb", "chunk_size": 16})


def test_first_sample_swapped_out_while_the_others_wait_for_its_prompt():
    with Engine.from_config(_config()) as plain:
        singles = plain.generate([PROMPT] * 3, [PARAMS.model_copy(update={"n": 1, "seed": 7 + i})
                                                for i in range(3)])
    with Engine.from_config(_config(preemption_mode="swap")) as engine:
        engine.add_request(Request("r", PROMPT, PARAMS))
        engine.step()                            # the first sample's first prompt chunk
        scheduler = engine.scheduler
        lead = engine._seqs[child_id("r", 0)]
        assert 0 < lead.num_computed_tokens < 64 and engine._sampling.holding
        scheduler._preempt(lead)                 # as a KV shortage would: swapped, not dropped
        assert scheduler.num_swapped == 1 and engine._sampling.holding
        outs = []
        while engine.has_unfinished():
            outs.extend(engine.step())
        out, = outs
        stats = engine.stats()
        bm = scheduler.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks
    assert stats["kv_swap"]["swap_outs"] == 1 and stats["kv_swap"]["swap_ins"] == 1
    assert [s.output_token_ids for s in out.samples] == [s.output_token_ids for s in singles]
    # the held samples still started from the first one's blocks: ~one prompt computed
    assert stats["computed_prefill_tokens"] < len(PROMPT) + 2 * 16


class _CountedList(list):
    """A list that counts the passes made over it."""

    passes = 0

    def __iter__(self):
        type(self).passes += 1
        return super().__iter__()


def test_a_finished_sample_is_found_without_a_pass_over_its_requests_samples():
    """n = 16,384 (vLLM's limit) finishing one sample at a time: each finish found its index by
    a pass over the n samples (n^2 / 2 comparisons: 20 s of a 73 s request on the tiny model);
    the fan-in still gives the samples in index order, whatever order they end in."""
    from batchinfer.engine.request import FinishReason, RequestOutput

    with Engine.from_config(_config()) as engine:
        engine.add_request(Request("r", PROMPT[:8], PARAMS.model_copy(update={"n": 64})))
        sampling = engine._sampling
        parent = sampling._parents["r"]
        children = parent.children = _CountedList(parent.children)
        results = [sampling.finished(seq, RequestOutput(
            request_id=seq.request_id, prompt_token_ids=PROMPT[:8], output_token_ids=[i],
            text="", finish_reason=FinishReason.LENGTH)) for i, seq in reversed(list(
                enumerate(children)))]
        passes = _CountedList.passes - 1          # the one pass above
        engine.abort_all()
    assert results[:-1] == [None] * 63
    assert [s.output_token_ids for s in results[-1].samples] == [[i] for i in range(64)]
    assert passes == 0
