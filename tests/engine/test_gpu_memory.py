"""KV sizing on a GPU (engine/gpu_memory.py): the arithmetic and its errors with fake memory
figures, and the profiled step itself on CPU (the measurement around it needs CUDA)."""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.errors import ConfigError
from batchinfer.engine.gpu_memory import GiB, GpuMemory, kv_budget_on_gpu, profile_step

H100 = GpuMemory(total=80 * GiB, weights=15 * GiB, activation_peak=2 * GiB, other=GiB // 2)


def test_the_kv_gets_what_utilization_leaves_after_weights_activations_and_other_use():
    budget = kv_budget_on_gpu(H100, 0.9, None, min_bytes=16 * GiB, what_min="131072 tokens")
    assert budget == int(80 * GiB * 0.9) - 15 * GiB - 2 * GiB - GiB // 2


def test_a_model_that_leaves_too_little_kv_is_refused_with_the_numbers():
    small = GpuMemory(total=24 * GiB, weights=15 * GiB, activation_peak=3 * GiB, other=GiB)
    with pytest.raises(ConfigError) as err:
        kv_budget_on_gpu(small, 0.9, None, min_bytes=16 * GiB, what_min="max_model_len 131072 tokens")
    text = str(err.value)
    for figure in ("24.0 GiB", "21.6 GiB", "weights 15.00 GiB", "activation peak 3.00 GiB",
                   "held elsewhere 1.00 GiB", "leaves 2.60 GiB", "131072 tokens need 16.00 GiB"):
        assert figure in text, (figure, text)


def test_an_explicit_kv_size_is_kept_when_it_fits_and_refused_when_it_does_not():
    assert kv_budget_on_gpu(H100, 0.5, 40 * GiB, min_bytes=GiB, what_min="x") == 40 * GiB
    with pytest.raises(ConfigError, match=r"kv_cache_memory 70.00 GiB does not fit.*leaves 62.50 GiB"):
        kv_budget_on_gpu(H100, 0.9, 70 * GiB, min_bytes=GiB, what_min="x")


def test_the_profiled_step_runs_the_largest_step_and_leaves_the_model_as_it_was(make_engine,
                                                                              tiny_engine_config):
    from tests.greedy import greedy_tokens

    engine = make_engine(**tiny_engine_config)
    executor = engine.replicas[0].executor
    prompts = [[5, 6, 7, 8], [9] * 30]
    before = greedy_tokens(engine, prompts, batched=True, max_new=4)
    arch = executor.model.arch
    temp = profile_step(executor.model, executor.backend, arch, max_tokens=700, max_seqs=64,
                        max_model_len=512, block_size=16, kv_dtype=torch.float32,
                        device=torch.device("cpu"))
    # 700 tokens as sequences of 512 + 188: 32 + 12 blocks of K and V over every layer
    assert temp == 44 * 2 * arch.num_layers * arch.num_kv_heads * 16 * arch.head_dim * 4
    assert greedy_tokens(engine, prompts, batched=True, max_new=4) == before


def test_the_engine_asks_for_max_model_len_tokens_of_kv_and_names_them(monkeypatch):
    """build._gpu_kv_budget's wiring, with the measurement faked (it needs CUDA)."""
    from batchinfer.engine import build, gpu_memory
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.model.arch import read_arch
    from pathlib import Path

    arch = read_arch(Path(__file__).resolve().parents[2] / "examples/model-configs/llama-3.1-8b")
    seen = {}

    def fake_measure(model, backend, arch_, max_tokens, max_seqs, max_model_len, block, kv_dtype, dev):
        seen.update(max_tokens=max_tokens, max_seqs=max_seqs, block=block)
        return GpuMemory(total=24 * GiB, weights=15 * GiB, activation_peak=GiB, other=GiB // 2)

    monkeypatch.setattr(gpu_memory, "measure", fake_measure)
    config = EngineConfig(scheduler={"max_num_batched_tokens": 4096, "max_num_seqs": 128})
    cuda = torch.device("cuda")
    # 8192 tokens x 128 KiB (32 layers x 8 kv heads x 128 x 2 bytes x K and V) = 1 GiB: fits
    budget = build._gpu_kv_budget(config, None, None, arch, 8192, torch.bfloat16, cuda)
    assert budget == int(24 * GiB * 0.9) - 15 * GiB - GiB - GiB // 2
    assert seen == {"max_tokens": 4096, "max_seqs": 128, "block": 16}
    with pytest.raises(ConfigError, match="max_model_len 131072 tokens need 16.00 GiB"):
        build._gpu_kv_budget(config, None, None, arch, 131072, torch.bfloat16, cuda)
