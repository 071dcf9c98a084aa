"""GPT-OSS's pieces against transformers' (issue 42): the biased experts with the clamped
SwiGLU, its router, MXFP4 experts de-quantized at load, expert load, the TP error and the
shipped config. Its end-to-end parity runs with the other families (test_model_families.py)."""
from __future__ import annotations

import pytest
import torch

from tests.greedy import greedy_tokens
from tests.bf16_rounding import to_bf16
from tests.tiny_families import FAMILIES, MAX_NEW, TINY, hf_greedy, hf_model, save_model, tiny_arch


def _gpt_oss_reference(x, gate_up, gate_up_bias, down, down_bias, weights, ids, alpha, limit,
                       rounded=lambda v: v):
    """transformers' GptOssExperts maths, one token and one expert at a time, over our layout
    (gate rows, then up rows); `rounded`: what each GEMM's input goes through first."""
    out = torch.zeros_like(x)
    rows = gate_up.shape[1] // 2
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            h = gate_up[e] @ rounded(x[t]) + gate_up_bias[e]
            gate, up = h[:rows].clamp(max=limit), h[rows:].clamp(-limit, limit)
            inner = rounded((up + 1) * gate * torch.sigmoid(alpha * gate))
            out[t] += w * (down[e] @ inner + down_bias[e])
    return out


@pytest.mark.parametrize("packed", [None, torch.float32, torch.bfloat16])
def test_biased_experts_with_the_clamped_swiglu_equal_a_per_token_reference(packed):
    """GPT-OSS's experts (biases after both projections, the clamped SwiGLU, limit low enough
    to clamp) grouped as the other families' are, packed for the blocked kernel or not."""
    from batchinfer.engine.model.fused_experts import BiasedExperts, route_topk_softmax
    from batchinfer.engine.model.ops import TorchOps

    gen = torch.Generator().manual_seed(0)
    experts = BiasedExperts(16, 32, 16, (1.702, 1.0))
    with torch.no_grad():
        for param, shape in ((experts.gate_up, (16, 32, 32)), (experts.down, (16, 32, 16)),
                             (experts.gate_up_bias, (16, 32)), (experts.down_bias, (16, 32))):
            param.copy_(torch.randn(*shape, generator=gen) * 0.5)
    dense = [p.detach().clone() for p in (experts.gate_up, experts.gate_up_bias, experts.down,
                                          experts.down_bias)]
    if packed is not None:
        experts.pack(packed)
        dense[0], dense[2] = (w.float() for w in experts.dense_weights())
    x = torch.randn(5, 32, generator=gen)
    weights, ids = route_topk_softmax(torch.randn(5, 16, generator=gen), 2)
    with torch.inference_mode():
        out = experts(x, weights, ids, TorchOps)
    gate_up, gate_up_bias, down, down_bias = dense
    h = torch.einsum("erh,th->ter", gate_up, x)
    assert (h.abs() > 1.0).any()                       # the clamps bite
    # the native bf16 kernels (dpbf16 on AVX512-BF16, amx on AMX) also round each GEMM's input
    rounds_input = experts.panel_kernel in ("dpbf16", "amx")
    expected = _gpt_oss_reference(x, gate_up, gate_up_bias, down, down_bias, weights, ids,
                                  1.702, 1.0, to_bf16 if rounds_input else (lambda v: v))
    tolerance = 1e-4 if rounds_input else 1e-5     # an input near a rounding boundary
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
    assert experts.load.tolist() == torch.bincount(ids.flatten(), minlength=16).tolist()


def test_the_gpt_oss_router_softmaxes_its_top_k_logits_as_transformers():
    import transformers

    from batchinfer.engine.model.fused_experts import route_topk_softmax

    config = transformers.GptOssConfig(**{**TINY, **FAMILIES["gpt_oss"][2]})
    router = transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter(config)
    with torch.no_grad():
        router.weight.normal_(0, 1)
        router.bias.normal_(0, 1)
    x = torch.randn(6, 64)
    with torch.no_grad():
        logits, scores, indices = router(x)
    weights, ids = route_topk_softmax(logits, 2)
    assert ids.tolist() == indices.tolist()
    torch.testing.assert_close(weights, scores)


def _mxfp4(dense_out_in: torch.Tensor, gen: torch.Generator):
    """Random MXFP4 blocks and scales of the shape of `dense_out_in` [E, out, in]."""
    e, out, inner = dense_out_in.shape
    blocks = torch.randint(0, 256, (e, out, inner // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(117, 123, (e, out, inner // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory, default_model_dir):
    """The tiny GPT-OSS saved with its experts in MXFP4 (random codes) as the released
    checkpoints keep them, and transformers' model with the experts de-quantized by
    transformers' own convert_moe_packed_tensors; the plain checkpoint beside it."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = hf_model("gpt_oss")
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for layer in model.model.layers:
        ex = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(ex, name)                                  # [E, in, out]
            blocks, scales = _mxfp4(param.detach().transpose(1, 2), gen)
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            tensors[name] = (blocks, scales)
        ex.mxfp4 = tensors.copy()
    plain = save_model(model, tmp_path_factory.mktemp("gpt_oss_plain"), default_model_dir)
    path = save_model(model, tmp_path_factory.mktemp("gpt_oss_mxfp4"), default_model_dir)
    saved = load_file(path / "model.safetensors")
    for i, layer in enumerate(model.model.layers):
        for name, (blocks, scales) in layer.mlp.experts.mxfp4.items():
            prefix = f"model.layers.{i}.mlp.experts.{name}"
            del saved[prefix]
            saved[f"{prefix}_blocks"], saved[f"{prefix}_scales"] = blocks, scales
    save_file(saved, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(cfg))
    return path, plain, model


def test_mxfp4_experts_are_dequantized_at_load(gpt_oss_mxfp4, make_engine):
    """An MXFP4 checkpoint (`*_blocks` / `*_scales`): the experts equal the plain checkpoint's
    (transformers' de-quantization), whole and in each TP rank's rows, and greedy tokens equal
    transformers' on the de-quantized model."""
    from batchinfer.engine.model.causal_lm import ModelPartition
    from batchinfer.engine.model.loader import build_model, load_arch
    from batchinfer.resharding.weights import ShapeOnlyGroup
    from tests.tiny_families import PROMPTS

    path, plain, model = gpt_oss_mxfp4
    arch, cpu = load_arch(path), torch.device("cpu")
    assert arch.moe.mxfp4 and not load_arch(plain).moe.mxfp4
    for partition in (ModelPartition(), ModelPartition(tp_rank=1, tp_size=2)):
        group = ShapeOnlyGroup(partition) if partition.tp_size > 1 else None
        ours, theirs = (build_model(p, load_arch(p), torch.float32, cpu, 64, partition,
                                    tp_group=group, pack=False) for p in (path, plain))
        for a, b in zip(ours.layers, theirs.layers):
            assert torch.equal(a.mlp.experts.gate_up, b.mlp.experts.gate_up)
            assert torch.equal(a.mlp.experts.down, b.mlp.experts.down)
    engine = make_engine(model={"path": str(path), "max_model_len": 256},
                         cache={"kv_cache_memory": "8MiB"}, scheduler={"policy": "sb"})
    assert greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW) == \
        hf_greedy(model, PROMPTS)


def test_seesaws_host_copy_of_an_mxfp4_checkpoint_is_counted_as_it_is_held(gpt_oss_mxfp4):
    """host_copy_bytes (Seesaw's start-up memory check) equals what HostWeights.load keeps:
    an MXFP4 checkpoint's packed blocks and scales (as fp32), not the de-quantized experts;
    dummy weights are drawn de-quantized."""
    from batchinfer.engine.model.causal_lm import ModelPartition
    from batchinfer.engine.model.loader import load_arch
    from batchinfer.resharding.weights import HostWeights, host_copy_bytes

    path, plain, _ = gpt_oss_mxfp4
    arch = load_arch(path)
    partitions = [ModelPartition(0, 1), ModelPartition(tp_rank=1, tp_size=2)]
    for dummy in (False, True):
        held = HostWeights.load(path, arch, partitions, dummy=dummy).nbytes
        assert host_copy_bytes(arch, partitions, dummy) == held
    assert host_copy_bytes(arch, partitions) < host_copy_bytes(arch, partitions, dummy=True)


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from batchinfer.engine.model.gpt_oss import dequantize_mxfp4

    gen = torch.Generator().manual_seed(1)
    blocks, scales = _mxfp4(torch.empty(3, 48, 64), gen)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 48, 64)
    assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales,
                                                                          dtype=torch.float32))


@pytest.mark.parametrize("rows,tp,kv_heads", [(96, 2, 2), (160, 4, 4)])
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_each_rank_dequantizes_its_mxfp4_share_as_whole_then_cut(monkeypatch, rows, tp,
                                                                 kv_heads, chunk):
    """Each TP rank's experts, from its share of the MXFP4 blocks and scales (the loader's
    targets and slices), equal the whole projection de-quantized, then cut to the rank's rows
    (gate/up's interleaved rows split by hand), to the bit. Down's rank shares start inside a
    group of 32 (48 of 96 rows; 40 of 160). `chunk`: experts a de-quantization makes at once
    (None: the default budget, every expert here; 3: 3 + 3 + 2 of 8), and no call makes more
    values than that many experts' share of the rank: a rank that de-quantized its experts whole
    before cutting them (or every expert at once) would make more."""
    import dataclasses
    import math

    from batchinfer.engine.model import gpt_oss
    from batchinfer.engine.model.causal_lm import ModelPartition
    from batchinfer.engine.model.loader import empty_partition
    from batchinfer.resharding.weights import ShapeOnlyGroup

    arch = tiny_arch("gpt_oss", intermediate_size=rows, num_key_value_heads=kv_heads)
    arch = dataclasses.replace(arch, moe=dataclasses.replace(arch.moe, mxfp4=True))
    experts, hidden, share = arch.moe.num_experts, arch.hidden_size, rows // tp
    gen = torch.Generator().manual_seed(3)
    whole = {"gate_up_proj": _mxfp4(torch.empty(experts, 2 * rows, hidden), gen),
             "down_proj": _mxfp4(torch.empty(experts, hidden, rows), gen)}
    gate_up, down = (gpt_oss.dequantize_mxfp4(*whole[n]) for n in ("gate_up_proj", "down_proj"))
    made, dequantize = [], gpt_oss.dequantize_mxfp4

    def recorded(blocks, scales):
        out = dequantize(blocks, scales)
        made.append(tuple(out.shape))
        return out

    monkeypatch.setattr(gpt_oss, "dequantize_mxfp4", recorded)
    if chunk is not None:        # bytes of `chunk` experts' gate/up share: down's is no larger
        monkeypatch.setattr(gpt_oss, "DEQUANT_CHUNK_BYTES", chunk * 2 * share * hidden * 4)
    for rank in range(tp):
        partition = ModelPartition(tp_rank=rank, tp_size=tp)
        model, filler = empty_partition(arch, 64, partition, ShapeOnlyGroup(partition))
        made.clear()
        for proj, (blocks, scales) in whole.items():
            for kind, tensor in (("blocks", blocks), ("scales", scales)):
                name = f"model.layers.0.mlp.experts.{proj}_{kind}"
                for where in filler.targets(name):
                    filler.put(name, where.take(tensor), where)
        ours = model.layers[0].mlp.experts
        lo = rank * share
        mine = gate_up[:, 2 * lo:2 * (lo + share)]
        assert torch.equal(ours.gate_up, torch.cat([mine[:, 0::2], mine[:, 1::2]], dim=1))
        assert torch.equal(ours.down, down[:, :, lo:lo + share])
        assert filler.filled["layers.0.mlp.experts.gate_up"] == experts * 2 * share
        assert filler.filled["layers.0.mlp.experts.down"] == experts * hidden
        step = chunk or experts
        assert max(map(math.prod, made)) <= step * 2 * share * hidden
        gate_up_calls = [shape[0] for shape in made if shape[1:] == (2 * share, hidden)]
        assert gate_up_calls == [min(step, experts - e) for e in range(0, experts, step)]


def test_a_gpt_oss_batch_leaves_experts_without_tokens_and_reports_their_load(make_engine,
                                                                            family_dir):
    """One sequence decoding on 8 experts, top 2, two sparse layers: each decode step routes 4
    (token, expert) pairs, so at least 4 experts get none; transformers' tokens all the same."""
    path, model = family_dir("gpt_oss")
    engine = make_engine(model={"path": str(path), "max_model_len": 256},
                         cache={"kv_cache_memory": "8MiB"}, scheduler={"policy": "sb"})
    engine.drain_step_events()
    prompts = [list(range(150, 190))]                  # past the 16-key window
    assert greedy_tokens(engine, prompts, batched=True, max_new=MAX_NEW) == \
        hf_greedy(model, prompts)
    events = engine.drain_step_events()
    for event in events:
        tokens = event["num_prefill_tokens"] + event["num_decode_tokens"]
        assert sum(event["expert_tokens"]) == tokens * 2 * 2
    decode = [e for e in events if e["num_prefill_tokens"] == 0]
    assert decode and all(e["expert_tokens"].count(0) >= 4 for e in decode)
    assert len(engine.stats()["expert_load"]["per_layer"]) == 2


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, default_model_dir):
    built = {}

    def get(family):
        if family not in built:
            model = hf_model(family)
            built[family] = (save_model(model, tmp_path_factory.mktemp(family), default_model_dir),
                             model)
        return built[family]

    return get


def test_a_tensor_parallel_size_gpt_oss_does_not_allow_names_the_counts():
    from batchinfer.engine.config import ParallelConfig
    from batchinfer.engine.errors import ConfigError
    from batchinfer.engine.runtime.layout import ParallelLayout

    arch = tiny_arch("gpt_oss", num_attention_heads=8, num_key_value_heads=4, intermediate_size=18)
    with pytest.raises(ConfigError, match=r"tp=4 cannot split this model: the model's expert "
                                          r"intermediate size 18 is not divisible by tp: "
                                          r"allowed tp = 1, 2$"):
        ParallelLayout.resolve(ParallelConfig(tp=4), arch)
    with pytest.raises(ConfigError, match=r"tp=4 cannot split this model: the model has 4 "
                                          r"attention heads and 2 kv heads"):
        ParallelLayout.resolve(ParallelConfig(tp=4), tiny_arch("gpt_oss"))


def test_the_shipped_gpt_oss_20b_config_reads_at_its_real_size():
    """examples/model-configs/gpt-oss-20b (the published config.json, MXFP4 quantization_config
    included): 20.9 B parameters of which 3.6 B active, 128-key windows on every other layer,
    YaRN; its dummy weights are drawn de-quantized (checkpoint.hf_tensor_shapes)."""
    from pathlib import Path

    from batchinfer.engine.model.arch import read_arch
    from batchinfer.engine.model.checkpoint import hf_tensor_shapes
    from batchinfer.engine.model.shard import allowed_tp_sizes

    arch = read_arch(Path(__file__).resolve().parents[2] / "examples/model-configs/gpt-oss-20b")
    assert round(arch.num_params() / 1e9, 1) == 20.9
    assert round(arch.flops_per_token() / 2e9, 1) == 3.6
    assert arch.layer_windows == (128, 0) * 12 and arch.attention_sinks
    assert arch.rope_scaling["rope_type"] == "yarn" and arch.moe.mxfp4
    assert allowed_tp_sizes(arch) == [1, 2, 4, 8]
    quantized = dict(hf_tensor_shapes(arch))
    dense = dict(hf_tensor_shapes(arch, quantized=False))
    block = "model.layers.0.mlp.experts."
    assert quantized[block + "gate_up_proj_blocks"] == (32, 5760, 90, 16)
    assert quantized[block + "down_proj_scales"] == (32, 2880, 90)
    assert dense[block + "gate_up_proj"] == (32, 2880, 5760) and block + "down_proj_blocks" not in dense
    assert quantized["model.layers.3.self_attn.sinks"] == (64,)


@pytest.mark.slow
def test_the_shipped_gpt_oss_config_runs_with_dummy_weights(make_engine):
    """load_format dummy from the shipped config at its real widths (hidden 2,880, 64 heads of
    64, experts of 2,880 rows), fewer layers, experts and vocabulary (hf_overrides) so that it
    fits a CI host: the engine builds it and generates."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "examples/model-configs/gpt-oss-20b"
    engine = make_engine(model={"path": str(folder), "load_format": "dummy", "max_model_len": 256,
                                "hf_overrides": {"num_hidden_layers": 2, "num_local_experts": 4,
                                                 "vocab_size": 8192,
                                                 "layer_types": ["sliding_attention",
                                                                 "full_attention"]}},
                         cache={"kv_cache_memory": "64MiB"})
    out = greedy_tokens(engine, [list(range(100, 300))], batched=True, max_new=2)
    assert len(out[0]) == 2


def test_fewer_layers_by_hf_overrides_take_the_first_layers_types():
    """hf_overrides.num_hidden_layers alone on a config with per-layer lists (GPT-OSS's
    layer_types) keeps the first layers' entries (transformers refused the config, and the run
    ended in a traceback and exit 3); a config transformers still rejects is a ModelLoadError
    (exit 2) naming the source."""
    import json
    from pathlib import Path

    from batchinfer.engine.errors import ModelLoadError
    from batchinfer.engine.model.arch import arch_from_dict
    from batchinfer.engine.model.loader import load_arch

    folder = Path(__file__).resolve().parents[2] / "examples/model-configs/gpt-oss-20b"
    arch = load_arch(folder, {"num_hidden_layers": 3})
    assert arch.num_layers == 3 and arch.checkpoint_layers == 24
    types = json.loads((folder / "config.json").read_text())["layer_types"]
    assert [bool(w) for w in arch.layer_windows] == [t == "sliding_attention" for t in types[:3]]
    cfg = {**json.loads((folder / "config.json").read_text()), "num_hidden_layers": 3}
    with pytest.raises(ModelLoadError, match="(?s)transformers rejects this config.*layer_types"):
        arch_from_dict(cfg, "gpt-oss-20b/config.json")


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_resharded_experts_equal_the_direct_shards(tmp_path, default_model_dir, family, request):
    """Seesaw's re-shard from the host copy (the loader's own slicing) gives a TP rank the same
    experts, shared expert and router as the direct loader: PP stage 0, then TP rank 1 of 2
    (GPT-OSS: its MXFP4 checkpoint, the pairs de-quantized from the host copy, and its sinks)."""
    from batchinfer.engine.model.causal_lm import ModelPartition
    from batchinfer.engine.model.fused_experts import StackedExperts
    from batchinfer.engine.model.loader import build_model, load_arch
    from batchinfer.resharding.weights import HostWeights, ShapeOnlyGroup

    path = (request.getfixturevalue("gpt_oss_mxfp4")[0] if family == "gpt_oss" else
            save_model(hf_model(family), tmp_path / family, default_model_dir))
    arch, cpu = load_arch(path), torch.device("cpu")
    stage, shard = ModelPartition(0, 1), ModelPartition(tp_rank=1, tp_size=2)
    host = HostWeights.load(path, arch, [stage, shard])
    host.build(arch, torch.float32, cpu, 64, stage)
    resharded, _ = host.build(arch, torch.float32, cpu, 64, shard, ShapeOnlyGroup(shard))
    direct = build_model(path, arch, torch.float32, cpu, 64, shard, tp_group=ShapeOnlyGroup(shard))

    def weights(model):
        out = {name: m.dense_weight() for name, m in model.named_modules()
               if hasattr(m, "dense_weight")}
        for name, m in model.named_modules():
            if isinstance(m, StackedExperts):
                out[f"{name}.gate_up"], out[f"{name}.down"] = m.dense_weights()
        return out

    ours, theirs = weights(resharded), weights(direct)
    assert ours.keys() == theirs.keys() and "layers.0.mlp.experts.gate_up" in ours
    if family == "gpt_oss":      # 64 of 128 rows each; the biases and sinks are parameters
        assert theirs["layers.0.mlp.experts.gate_up"].shape == (8, 128, 64)
        for model, into in ((resharded, ours), (direct, theirs)):
            into.update((n, p) for n, p in model.named_parameters() if "bias" in n or "sinks" in n)
        assert theirs["layers.0.self_attn.sinks"].shape == (2,)
    else:
        assert theirs["layers.0.mlp.experts.gate_up"].shape == (8, 32, 64)   # 16 of 32 rows each
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
