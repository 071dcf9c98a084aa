"""Mixtures of experts beyond the per-family parity of test_model_families.py (which runs the tiny
Qwen2-MoE, Qwen3-MoE and Mixtral through every check the dense families get, TP=2 and PP=2
included): the grouped expert computation against a per-token reference, a batch that leaves
most experts without a token, the expert load in the step events, the stats and the report,
and the errors: a TP size that cannot split the experts, CUDA graphs asked for, a checkpoint
whose expert tensors do not match the config."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.bf16_rounding import to_bf16
from tests.greedy import greedy_tokens
from tests.tiny_families import MAX_NEW, hf_greedy, hf_model, save_model, tiny_arch


def _reference(x, gate_up, down, weights, ids, rounded=lambda v: v):
    """Each token through each of its experts, one at a time; `rounded`: what each GEMM's input
    goes through first."""
    out = torch.zeros_like(x)
    rows = gate_up.shape[1] // 2
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            h = gate_up[e] @ rounded(x[t])
            out[t] += w * (down[e] @ rounded(torch.nn.functional.silu(h[:rows]) * h[rows:]))
    return out


@pytest.mark.parametrize("packed", [None, torch.float32, torch.bfloat16])
def test_grouped_experts_equal_a_per_token_reference(packed):
    """Sorted by expert, one GEMM chain per expert that got tokens, scattered back: the
    reference's sums, with most of 16 experts getting no token; the load counts each expert's
    tokens. `packed`: laid out for the CPU's kernel in that weight dtype (the blocked kernel's
    panels where it is built, the amx or dpbf16 kernel's for bf16 on native-bf16 CPUs; bf16: the
    reference over the rounded weights)."""
    from batchinfer.engine.model.fused_experts import StackedExperts, route
    from batchinfer.engine.model.fast_linear import blocked_kernel_available, linear_kernel_for
    from batchinfer.engine.model.ops import TorchOps

    gen = torch.Generator().manual_seed(0)
    experts = StackedExperts(16, 32, 16)
    with torch.no_grad():
        experts.gate_up.copy_(torch.randn(16, 32, 32, generator=gen) * 0.3)
        experts.down.copy_(torch.randn(16, 32, 16, generator=gen) * 0.3)
    gate_up, down = experts.gate_up.detach().clone(), experts.down.detach().clone()
    if packed is not None:
        experts.pack(packed)
        kernel = linear_kernel_for(torch.device("cpu"), packed)
        panels = kernel in ("dpbf16", "amx") or (kernel == "blocked" and blocked_kernel_available())
        assert (experts.panels is not None) == panels
        assert experts.panel_kernel == (kernel if panels else None)
        gate_up, down = (w.to(packed).float() for w in (gate_up, down))
        for ours, theirs in zip(experts.dense_weights(), (gate_up, down)):
            assert torch.equal(ours.float(), theirs)
    x = torch.randn(3, 32, generator=gen)
    weights, ids = route(torch.randn(3, 16, generator=gen), top_k=2, normalize=True)
    with torch.inference_mode():
        out = experts(x, weights, ids, TorchOps)
    # the native bf16 kernels (dpbf16, amx) also round each GEMM's input to bf16
    rounds_input = experts.panel_kernel in ("dpbf16", "amx")
    expected = _reference(x, gate_up, down, weights, ids,
                          to_bf16 if rounds_input else (lambda v: v))
    tolerance = 1e-4 if rounds_input else 1e-5     # an input near a rounding boundary
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
    load = experts.load.tolist()
    assert load == torch.bincount(ids.flatten(), minlength=16).tolist()
    assert sum(load) == 6 and load.count(0) >= 10


def test_experts_for_the_amx_kernel_pad_k_to_a_tile_and_round_trip(monkeypatch):
    """The layout alone (any CPU): each expert's pairs with k padded to 32, the dense stacks
    back bit for bit in bf16. Its outputs are the test above's on a CPU with AMX."""
    from batchinfer.engine.model import fused_experts
    from batchinfer.engine.model.fused_experts import StackedExperts

    monkeypatch.setattr(fused_experts, "linear_kernel_for", lambda device, dtype: "amx")
    monkeypatch.setattr(fused_experts, "amx_available", lambda: True)
    experts = StackedExperts(4, 48, 16)
    with torch.no_grad():
        experts.gate_up.normal_()
        experts.down.normal_()
    dense = [w.detach().to(torch.bfloat16) for w in (experts.gate_up, experts.down)]
    experts.pack(torch.bfloat16)
    assert experts.panel_kernel == "amx"
    gate_up, down = experts.panels
    assert gate_up.shape == (4, 2, 32, 16, 2)      # 32 rows in 2 panels, k 48 -> 64 in pairs
    assert down.shape == (4, 3, 16, 16, 2)         # 48 rows in 3 panels, k 16 -> 32 in pairs
    assert torch.all(gate_up[:, :, 24:] == 0) and torch.all(down[:, :, 8:] == 0)
    for ours, theirs in zip(experts.dense_weights(), dense):
        assert torch.equal(ours, theirs)


def test_routing_renormalizes_only_where_the_model_does():
    from batchinfer.engine.model.fused_experts import route

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    raw, ids = route(logits, 2, normalize=False)
    normed, same = route(logits, 2, normalize=True)
    assert ids.tolist() == same.tolist() == [[0, 1]]
    torch.testing.assert_close(raw, torch.softmax(logits, -1)[:, :2])
    torch.testing.assert_close(normed, raw / raw.sum())


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory, default_model_dir):
    model = hf_model("qwen3_moe")
    return save_model(model, tmp_path_factory.mktemp("qwen3_moe"), default_model_dir), model


def test_a_batch_leaving_experts_without_tokens_matches_transformers(make_engine, qwen3_moe):
    """Two short prompts on 16 experts, top 2: each decode step routes 4 (token, expert) pairs,
    so at least 12 experts get none; transformers' tokens all the same. Each step's event
    carries its tokens per expert (their sum: tokens x top_k x sparse layers) and the stats the
    totals per layer."""
    path, hf = qwen3_moe
    prompts = [[7], [5, 17, 300]]
    engine = make_engine(model={"path": str(path), "max_model_len": 256},
                         cache={"kv_cache_memory": "8MiB"}, scheduler={"policy": "sb"})
    engine.drain_step_events()
    assert greedy_tokens(engine, prompts, batched=True, max_new=MAX_NEW) == hf_greedy(hf, prompts)
    events = engine.drain_step_events()
    arch = engine.replicas[0].executor.model.arch
    assert arch.moe.num_sparse_layers == 1 and arch.moe.num_experts == 16
    for event in events:
        tokens = event["num_prefill_tokens"] + event["num_decode_tokens"]
        assert len(event["expert_tokens"]) == 16
        assert sum(event["expert_tokens"]) == tokens * arch.moe.top_k
    decode = [e for e in events if e["num_prefill_tokens"] == 0]
    assert decode and all(e["expert_tokens"].count(0) >= 12 for e in decode)
    load = engine.stats()["expert_load"]
    assert load["per_layer"] == [load["per_expert"]] and len(load["layers"]) == 1
    assert sum(load["per_expert"]) == sum(sum(e["expert_tokens"]) for e in events)
    mean = sum(load["per_expert"]) / len(load["per_expert"])
    assert load["max_over_mean"] == pytest.approx(max(load["per_expert"]) / mean, abs=0.01)


def test_pipeline_expert_counts_merge_by_layer_whatever_arrives():
    """A pipeline's stages send their layers' counts apart: they merge by decoder layer, so a
    stage whose counts have not arrived leaves its own layers out instead of shifting the last
    stage's onto them; a stale micro-batch's counts are dropped."""
    from collections import defaultdict
    from types import SimpleNamespace

    from batchinfer.engine.runtime.executor import PipelineExecutor

    executor = object.__new__(PipelineExecutor)
    executor.pool, executor.replica = SimpleNamespace(expert_loads=defaultdict(dict)), 0
    pending = executor.pool.expert_loads[0]
    pending[3] = {0: {1: [2, 0, 1]}}
    pending[1] = {0: {1: [9, 9, 9]}}                       # stale: never expected any more
    assert executor._expert_load(3, {"expert_load": {5: [0, 3, 0]}}) == {1: [2, 0, 1],
                                                                       5: [0, 3, 0]}
    assert dict(pending) == {}
    assert executor._expert_load(4, {"expert_load": {5: [1, 1, 1]}}) == {5: [1, 1, 1]}
    assert executor._expert_load(5, {}) is None


def test_expert_load_reaches_the_metrics_and_the_report():
    from batchinfer.runner.report.metrics import SessionMetrics
    from batchinfer.runner.report.report import render_markdown

    metrics = SessionMetrics()
    metrics.start({}, 0.0)
    metrics.on_steps([{"dur": 0.1, "expert_tokens": [3, 0, 1]},
                      {"dur": 0.1, "expert_tokens": [1, 0, 2]}])
    assert metrics.sample(1.0, {}, force=True)["expert_tokens"] == [4, 0, 3]
    report = {"engine": {"expert_load": {"per_expert": [4, 0, 3], "per_layer": [[4, 0, 3]],
                                         "max_over_mean": 1.7143}}}
    text = render_markdown(report, ())
    assert ("## Expert load" in text and "7 in all" in text and "1.7143x" in text
            and "1 without a token" in text)


def test_a_tensor_parallel_size_the_experts_do_not_allow_names_the_counts():
    from batchinfer.engine.config import ParallelConfig
    from batchinfer.engine.errors import ConfigError
    from batchinfer.engine.runtime.layout import ParallelLayout

    arch = tiny_arch("qwen2_moe", num_attention_heads=8, num_key_value_heads=4,
                 moe_intermediate_size=18, shared_expert_intermediate_size=50)
    with pytest.raises(ConfigError, match=r"tp=4 cannot split this model: the model's expert "
                                          r"intermediate size 18 and the shared expert "
                                          r"intermediate size 50 are not divisible by tp: "
                                          r"allowed tp = 1, 2$"):
        ParallelLayout.resolve(ParallelConfig(tp=4), arch)
    # Mixtral's layers are all sparse: its intermediate_size is each expert's
    assert tiny_arch("mixtral", intermediate_size=96).moe.intermediate_size == 96


def test_cuda_graphs_asked_for_a_mixture_of_experts_is_a_config_error():
    from batchinfer.engine.build_paths import use_cuda_graphs
    from batchinfer.engine.errors import ConfigError

    arch = tiny_arch("mixtral")
    assert use_cuda_graphs(None, "triton", arch) is False
    with pytest.raises(ConfigError, match="mixture-of-experts.*token counts on the host.*leave it empty"):
        use_cuda_graphs(True, "triton", arch)


def test_params_flops_and_working_memory_count_every_expert_and_the_active_ones():
    arch = tiny_arch("qwen2_moe")
    h, moe = arch.hidden_size, arch.moe
    expert = 3 * h * moe.intermediate_size
    shared = 3 * h * moe.shared_intermediate_size + h
    dense = tiny_arch("qwen2_moe", mlp_only_layers=[0, 1])     # the same model with no sparse layer
    dense_mlp = 3 * h * arch.intermediate_size
    ffn = arch.num_params() - dense.num_params() + 2 * dense_mlp
    assert ffn == 8 * expert + 8 * h + shared + dense_mlp
    flops = arch.flops_per_token() - dense.flops_per_token() + 2 * 2 * dense_mlp
    assert flops == 2 * (2 * expert + 8 * h + shared + dense_mlp)
    # a token's working values: its 2 copies in and out, 2 experts' gate/up and product, the
    # shared expert's (wider than the dense layer's 3 x 128)
    assert arch.ffn_activation_width() == 2 * (2 * h + 3 * 32) + 3 * 48 > 3 * 128


def _rewrite(path, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_an_expert_tensor_that_does_not_match_the_config_is_named_with_both_shapes(
        tmp_path, default_model_dir):
    from batchinfer.engine.errors import ModelLoadError
    from batchinfer.engine.model.loader import build_model, load_arch

    path = save_model(hf_model("mixtral"), tmp_path / "mixtral", default_model_dir)
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"

    def narrow(tensors):
        tensors[name] = tensors[name][:, :64].contiguous()

    _rewrite(path, narrow)
    with pytest.raises(ModelLoadError, match=rf"tensor '{name}' has shape \(64, 64\) in the "
                                             r"checkpoint, but config.json implies \(64, 128\)"):
        build_model(path, load_arch(path), torch.float32, torch.device("cpu"), 256)
    missing = "model.layers.0.block_sparse_moe.experts.3.w1.weight"
    _rewrite(path, lambda tensors: (tensors.pop(missing), tensors.__setitem__(
        name, torch.zeros(64, 128))))
    with pytest.raises(ModelLoadError, match=rf"missing 1 tensor.*'{missing}' \(128, 64\)"):
        build_model(path, load_arch(path), torch.float32, torch.device("cpu"), 256)


@pytest.mark.slow
@pytest.mark.parametrize("family,parallel,sipipe", [
    ("mixtral", {"tp": 2}, False), ("mixtral", {"pp": 2}, False), ("mixtral", {"pp": 2}, True),
    ("gpt_oss", {"tp": 2}, False), ("gpt_oss", {"pp": 2}, False)],
    ids=["tp2", "pp2", "sipipe-pp2", "gpt_oss-tp2", "gpt_oss-pp2"])
def test_worker_processes_report_every_sparse_layer(make_engine, tmp_path, default_model_dir,
                                                    family, parallel, sipipe):
    """Mixtral and GPT-OSS (both layers sparse, top 2) on worker processes: transformers'
    tokens, and each step's expert load covers both layers: at PP=2 the first stage's layer
    comes by its own message, the second's with the result (under SiPipe, whose sampler
    processes answer, by its own message too); at TP=2 one rank's count is the layer's.
    GPT-OSS at TP=2 splits its sinks by head and each expert's interleaved gate/up rows."""
    from batchinfer.strategies.sipipe.params import SiPipeParams
    from tests.tiny_families import PROMPTS

    model = hf_model(family)
    path = save_model(model, tmp_path / family, default_model_dir)
    batching = {"policy": "hb", "chunk_size": 16, "max_num_batched_tokens": 48}
    strategy = SiPipeParams(**batching) if sipipe else None
    with make_engine(model={"path": str(path), "max_model_len": 256},
                     cache={"kv_cache_memory": "8MiB"}, parallel=parallel, strategy=strategy,
                     scheduler=strategy.scheduler_config() if sipipe else batching) as engine:
        engine.drain_step_events()
        assert greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW) == \
            hf_greedy(model, PROMPTS)
        events = engine.drain_step_events()
        load = engine.stats()["expert_load"]
    assert len(load["per_layer"]) == 2 and load["layers"] == [0, 1]
    for event in events:
        tokens = event["num_prefill_tokens"] + event["num_decode_tokens"]
        assert sum(event["expert_tokens"]) == tokens * 2 * 2      # top 2, two sparse layers
    assert sum(map(sum, load["per_layer"])) == sum(sum(e["expert_tokens"]) for e in events)


def test_sidp_refuses_a_mixture_of_experts_by_name(make_engine, qwen3_moe):
    """SiDP's shared FFN holds one dense MLP per layer: a clear error, before any worker."""
    from batchinfer.engine.errors import ConfigError
    from batchinfer.strategies.sidp.params import SiDPParams

    with pytest.raises(ConfigError, match=r"strategy sidp .* \(qwen3_moe\) has a mixture of "
                                          r"experts: run it with another strategy"):
        make_engine(model={"path": str(qwen3_moe[0]), "max_model_len": 256},
                    cache={"kv_cache_memory": "8MiB"}, parallel={"dp": 2}, strategy=SiDPParams())


def test_profile_leaves_out_the_strategies_that_cannot_run_the_model():
    """SiDP's shared dense FFN store: not a candidate for a mixture of experts."""
    from batchinfer.sim.search import candidates
    from batchinfer.strategies.base import BaselineStrategy

    def names(arch):
        return {c.strategy["name"] for c in candidates(BaselineStrategy(), arch, 2)}

    moe, dense = tiny_arch("qwen3_moe"), tiny_arch("qwen3")
    assert "sidp" in names(dense) and "sidp" not in names(moe) and "baseline" in names(moe)
    assert "sidp" not in names(tiny_arch("gpt_oss")) and "baseline" in names(tiny_arch("gpt_oss"))


def test_a_config_routing_to_more_experts_than_it_has_is_an_error():
    from batchinfer.engine.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"config.json: 9 experts per token of 8 experts"):
        tiny_arch("qwen2_moe", num_experts_per_tok=9)


def test_the_experts_kernel_follows_device_moe_kernel():
    """device.moe_kernel: the Triton experts for a mixture of experts on CUDA (auto or triton),
    the per-expert path for torch, never for a dense model or on the CPU, where `triton` asked
    for is a ConfigError naming the key."""
    from batchinfer.engine.build_paths import moe_kernel_label, use_triton_experts_for
    from batchinfer.engine.errors import ConfigError

    moe, dense = tiny_arch("mixtral"), tiny_arch("llama3")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    has_triton = importlib.util.find_spec("triton") is not None
    assert use_triton_experts_for("auto", cuda, moe) is has_triton
    assert use_triton_experts_for("torch", cuda, moe) is False
    assert use_triton_experts_for("auto", cuda, dense) is False
    assert use_triton_experts_for("auto", cpu, moe) is False
    with pytest.raises(ConfigError, match="device.moe_kernel: triton runs on CUDA"):
        use_triton_experts_for("triton", cpu, moe)
    assert moe_kernel_label(moe, cuda, True) == "triton"
    assert moe_kernel_label(moe, cuda, False) == "torch"
    assert moe_kernel_label(moe, cpu, False) == "cpu"
    assert moe_kernel_label(dense, cpu, False) is None


def test_an_engine_on_the_cpu_reports_its_experts_kernel(make_engine, qwen3_moe):
    path, _ = qwen3_moe
    engine = make_engine(model={"path": str(path), "max_model_len": 256},
                         cache={"kv_cache_memory": "8MiB"})
    assert engine.info["moe_kernel"] == "cpu"
    with pytest.raises(Exception, match="moe_kernel"):
        make_engine(model={"path": str(path), "max_model_len": 256},
                    cache={"kv_cache_memory": "8MiB"}, device={"moe_kernel": "triton"})


def test_async_scheduling_runs_a_mixture_of_experts_and_keeps_its_expert_load(make_engine,
                                                                              qwen3_moe):
    """Steps launched ahead (asked for on the CPU; on CUDA the default with the Triton experts,
    which read nothing on the host): transformers' tokens, and each step's tokens per expert,
    taken on the device at the launch, reach its event when the step is collected."""
    from batchinfer.engine.steps_ahead import AsyncInProcessExecutor

    path, hf = qwen3_moe
    prompts = [[7], [5, 17, 300], list(range(150, 190))]
    engine = make_engine(model={"path": str(path), "max_model_len": 256},
                         cache={"kv_cache_memory": "8MiB"},
                         scheduler={"policy": "hb", "chunk_size": 16,
                                    "max_num_batched_tokens": 32, "async_scheduling": True})
    assert isinstance(engine.replicas[0].executor, AsyncInProcessExecutor)
    engine.drain_step_events()
    assert greedy_tokens(engine, prompts, batched=True, max_new=MAX_NEW) == hf_greedy(hf, prompts)
    events = engine.drain_step_events()
    top_k = engine.replicas[0].executor.model.arch.moe.top_k
    assert events and all(sum(e["expert_tokens"]) == top_k * (e["num_prefill_tokens"]
                                                              + e["num_decode_tokens"])
                          for e in events)
    assert sum(engine.stats()["expert_load"]["per_expert"]) == sum(
        sum(e["expert_tokens"]) for e in events)


def test_the_gpu_memory_probe_leaves_no_expert_load_behind(make_engine, qwen3_moe):
    """gpu_memory.profile_step runs the largest step through the model before the KV is sized
    (on CUDA); its routing is no step's, so the first real step's expert load must not carry it."""
    from batchinfer.engine.gpu_memory import profile_step

    path, _ = qwen3_moe
    engine = make_engine(model={"path": str(path), "max_model_len": 256},
                         cache={"kv_cache_memory": "8MiB"})
    executor = engine.replicas[0].executor
    model = executor.model
    model.take_expert_load()
    profile_step(model, executor.backend, model.arch, max_tokens=96, max_seqs=8,
                 max_model_len=256, block_size=16, kv_dtype=torch.float32,
                 device=torch.device("cpu"))
    assert all(sum(counts) == 0 for counts in model.take_expert_load().values())
