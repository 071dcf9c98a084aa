"""TD-Pipe with n > 1 samples (PP = 2, the tiny dummy-weight model): with the first sample's
prefill in flight nothing else waits, so its decode phase starts while the group's other samples
are still held for the first one's prompt blocks; they then start from those blocks; every sample gives its
n = 1 request's reply and every block comes back."""
from __future__ import annotations

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine
from batchinfer.engine.request import Request, SamplingParams
from batchinfer.strategies.tdpipe.params import TDPipeParams
from tests.conftest import TINY_LLAMA

MODEL = {"load_format": "dummy", "hf_overrides": TINY_LLAMA, "max_model_len": 128}
PROMPT = list(range(100, 170))        # 70 tokens: four full blocks, then a partial one
KV = "96KiB"                          # per stage: 24 blocks of 16 tokens
PARAMS = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=8, ignore_eos=True)


def test_decode_phase_starts_before_every_sample_is_admitted():
    with Engine.from_config(EngineConfig(model=MODEL, cache={"kv_cache_memory": "16MiB"})) as plain:
        singles = plain.generate([PROMPT] * 3, [PARAMS.model_copy(update={"n": 1, "seed": 7 + i})
                                                for i in range(3)])
    params = TDPipeParams(max_num_batched_tokens=64, profile_decode_batch_sizes=[1, 4],
                          profile_prefill_tokens=[32, 64], profile_context_len=16)
    with Engine.from_config(EngineConfig(model=MODEL, cache={"kv_cache_memory": KV},
                                         strategy=params, parallel={"pp": 2})) as engine:
        scheduler = engine.scheduler
        engine.add_request(Request("r", PROMPT, PARAMS))
        outs, decode_while_held = [], []
        while engine.has_unfinished():
            outs.extend(engine.step())
            decode_while_held.append(scheduler.phase == "decode" and engine._sampling.holding)
        out, = outs
        bm = scheduler.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks
        prefill = engine.stats()["computed_prefill_tokens"]
    assert decode_while_held[0]       # the decode phase began with two samples held
    assert [s.output_token_ids for s in out.samples] == [s.output_token_ids for s in singles]
    assert prefill < len(PROMPT) + 2 * 16
