"""The Triton paged kernel's sliding window and logit soft-cap (Gemma 2 / 3) and attention sinks
(GPT-OSS) against the per-sequence definition; in Triton's interpreter without a GPU
(tests/triton_interpreter.py)."""
from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import DEVICE  # first: the interpreter's setup
from batchinfer.engine.attention import AttentionMetadata  # noqa: E402
from batchinfer.engine.torch_attention import reference_attention  # noqa: E402
from batchinfer.engine.triton_attention import TritonAttention  # noqa: E402
from tests.paged_cases import paged_case  # noqa: E402

MIXED = ([1, 1, 7, 40, 1, 3], [1, 90, 7, 61, 17, 70])   # short: the interpreter is slow


@pytest.mark.parametrize("window,softcap,block_size", [(5, 0.0, 16), (16, 0.0, 16), (37, 0.0, 8),
                                                       (0, 0.5, 16), (24, 0.3, 16)])
def test_window_and_softcap_equal_the_definition(window, softcap, block_size):
    q, kc, vc, meta = paged_case(3, 32, 4, 2, block_size, *MIXED)
    q = q * 4
    expected = reference_attention(q, kc, vc, meta, 0.125, window, softcap)
    moved = AttentionMetadata.build(meta.query_lens_cpu, meta.seq_lens_cpu,
                                    meta.block_tables.tolist(), block_size, DEVICE)
    got = TritonAttention().attend(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), moved, 0.125,
                                   window, softcap)
    torch.testing.assert_close(got.cpu(), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (16, 0.0), (24, 0.3)])
def test_sinks_equal_the_definition(window, softcap):
    """Decode rows and prefill programs, each head's sink in its rows' denominators."""
    from tests.kernels.test_attention_sinks import sink_definition

    q, kc, vc, meta = paged_case(3, 32, 4, 2, 16, *MIXED)
    q, sinks = q * 4, torch.linspace(-3.0, 4.0, 4)
    expected = sink_definition(q, kc, vc, meta, 0.125, sinks, window, softcap)
    moved = AttentionMetadata.build(meta.query_lens_cpu, meta.seq_lens_cpu,
                                    meta.block_tables.tolist(), 16, DEVICE)
    got = TritonAttention().attend(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), moved, 0.125,
                                   window, softcap, sinks=sinks.to(DEVICE))
    torch.testing.assert_close(got.cpu(), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("family", ["gemma2", "olmo2", "gpt_oss"])
def test_the_cuda_path_gives_the_torch_paths_tokens_on_the_new_layers(tmp_path, make_engine,
                                                                      default_model_dir, family):
    """Tiny models (tests/tiny_families.py) whose layers reach the CUDA path's kernels in new
    ways: greedy tokens with the Triton kernel and triton_ops.py's element-wise kernels, then
    with decode steps through the CUDA graphs' forward (eager here: capture needs a GPU), equal
    the torch path's. Gemma 2: sliding windows and soft-caps handed to both; OLMo 2: q and k
    normalized over all heads (strided rows); GPT-OSS: attention sinks beside the windows."""
    from batchinfer.engine.cuda_graphs import DecodeGraphs
    from batchinfer.engine.triton_ops import TritonOps
    from tests.greedy import greedy_tokens
    from tests.tiny_families import hf_model, save_model

    path = save_model(hf_model(family), tmp_path / family, default_model_dir)
    engine = make_engine(model={"path": str(path), "max_model_len": 128, "dtype": "float32"},
                         device={"device": "cpu", "attention_backend": "torch"},
                         cache={"kv_cache_memory": "8MiB"},
                         scheduler={"policy": "hb", "max_num_batched_tokens": 32, "chunk_size": 16})
    executor = engine.replicas[0].executor
    prompts = [[7], list(range(200, 230))]          # the second runs past the 16-key windows
    expected = greedy_tokens(engine, prompts, batched=True, max_new=3)
    executor.backend = TritonAttention()
    executor.model.use_ops(TritonOps)
    assert greedy_tokens(engine, prompts, batched=True, max_new=3) == expected
    executor.graphs = DecodeGraphs(executor.model, executor.kv_caches, executor.block_manager,
                                   torch.device("cpu"), max_batch=4, max_seq_len_to_capture=128,
                                   capture=False, triton_attention=True)
    assert greedy_tokens(engine, prompts, batched=True, max_new=3) == expected
    assert executor.graphs.steps >= 2


@pytest.mark.parametrize("window,block_size", [(24, 16), (37, 8)])
def test_slots_released_for_the_window_do_not_change_the_output(window, block_size):
    """Its first key tile may cover slots released for the window (a placeholder block holding
    anything): read and masked, the output is the one over the original blocks."""
    from tests.kernels.test_released_window_slots import released_case

    q, kc, vc, meta, released = released_case(window, block_size)

    def attend(m):
        moved = AttentionMetadata.build(m.query_lens_cpu, m.seq_lens_cpu, m.block_tables.tolist(),
                                        block_size, DEVICE)
        return TritonAttention().attend(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), moved, 0.125,
                                        window).cpu()

    torch.testing.assert_close(attend(released), attend(meta), rtol=1e-5, atol=1e-5)
