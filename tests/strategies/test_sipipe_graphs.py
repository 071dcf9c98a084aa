"""SiPipe's token-safe execution bound to decode graphs (engine/runtime/worker_graphs.py): two
graphs per batch size, one per input version, staged on the preparation thread and replayed by
the forward. Capture needs a GPU (benchmarks/engine/cuda_check.sh runs SiPipe on one there);
here the same padded forward runs eagerly (`capture: false`) in the worker on CPU, so the
versions' staging, the padding block past the scheduler's pool and the handshake are checked
against the eager forward's tokens."""
from __future__ import annotations

import pytest

from batchinfer.engine.runtime.worker_graphs import WorkerGraphSpec
from tests.strategies.test_sipipe import E2E, _e2e_params


def _graphs_on_cpu(config, setup, layout, token_safe, max_num_seqs):
    """decode_graph_spec as on a GPU, without the capture (the controller's choice, forced)."""
    if not (token_safe and layout.tp == 1 and layout.pp == 1):
        return None
    return WorkerGraphSpec(max_num_seqs, min(256, setup.max_model_len), capture=False)


@pytest.mark.slow
def test_decode_steps_run_through_both_versions_graphs_with_the_eager_tokens(make_engine,
                                                                            monkeypatch):
    """One rank (SiPipe's one-GPU layout), CPU samplers with every penalty on: the graphed run
    samples the eager run's tokens, its decode steps replayed both versions' graphs and its
    prefill steps ran eagerly; with token-safe execution off no graph runs."""
    from batchinfer.strategies.sipipe import build
    from batchinfer.strategies.sipipe.params import SiPipeParams

    monkeypatch.setenv("BATCHINFER_EVENT_FLUSH_S", "0")    # every step's events reach us
    params = _e2e_params()
    model = {"max_model_len": 512}
    engine_args = dict(model=model, cache={"kv_cache_memory": "64MiB"},
                       device={"attention_backend": "torch"})
    strategy = SiPipeParams(policy="hb", chunk_size=16, max_num_batched_tokens=64)
    with make_engine(**engine_args, strategy=strategy,
                     scheduler=strategy.scheduler_config()) as eager:
        expected = [o.output_token_ids for o in eager.generate(E2E, params)]
        assert eager.info["sipipe"]["decode_graphs"] == "off"
    monkeypatch.setattr(build, "decode_graph_spec", _graphs_on_cpu)
    for token_safe in (True, False):
        strategy = SiPipeParams(policy="hb", chunk_size=16, max_num_batched_tokens=64,
                                token_safe_execution=token_safe)
        with make_engine(**engine_args, strategy=strategy,
                         scheduler=strategy.scheduler_config()) as eng:
            outs = eng.generate(E2E, params)
            forwards = [e for e in eng.replicas[0].executor.timeline()
                        if e["kind"] == "forward"]
            info = eng.info["sipipe"]
        assert [o.output_token_ids for o in outs] == expected
        versions = [e.get("graph") for e in forwards]
        if token_safe:
            assert info["decode_graphs"] == "two per batch size, one per input version"
            assert versions.count(0) > 2 and versions.count(1) > 2     # decode, both versions
            assert None in versions                                    # prefill, eagerly
        else:
            assert info["decode_graphs"] == "off" and set(versions) == {None}
