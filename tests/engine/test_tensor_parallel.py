"""Tensor parallelism: shard maths, sliced loading, and TP ranks in spawned processes matching
the single-process model on the same weights (dummy and real)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from batchinfer.engine.attention import AttentionMetadata, NativeCPUAttention, TorchAttention
from batchinfer.engine.errors import ConfigError
from batchinfer.engine.kernels import load_native_kernels
from batchinfer.engine.model.arch import arch_from_dict
from batchinfer.engine.model.causal_lm import CausalLM, ModelPartition
from batchinfer.engine.model.loader import build_model, dummy_tensor, hf_tensor_shapes, load_arch
from batchinfer.engine.model.ops import NativeOps, TorchOps
from batchinfer.engine.model.shard import (TensorParallelGroup, check_tensor_parallel, shard_sizes,
                                           vocab_range, vocab_shard_size)
from tests.tiny_families import paged_prefill_inputs

CPU = torch.device("cpu")
BLOCK = 16
# the embedded SmolLM2 config reshaped so that heads split by 2 (head_dim 64); an odd vocab makes
# the last vocab shard part padding
TP2_MODEL = {"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 512,
             "head_dim": 64, "num_hidden_layers": 3, "intermediate_size": 1024, "vocab_size": 5001}
PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 123)), list(range(4000, 5000, 25))]  # 5, 23, 40 tokens
DECODE_STEPS = 6


def _backends(names=("torch", "native")):
    """(ops, attention backend) pairs by name; native only where its kernels build."""
    pairs = {"torch": (TorchOps, TorchAttention())}
    if load_native_kernels():
        pairs["native"] = (NativeOps, NativeCPUAttention())
    return [pairs[n] for n in names if n in pairs]


def generate(model, backend, prompts, steps):
    """Greedy: one prefill of all prompts, then `steps` decode steps through the paged KV cache.
    -> (logits of every step stacked [steps + 1, seqs, vocab], tokens [seqs, steps + 1])."""
    kv, tables, lens, ids, positions = paged_prefill_inputs(model, prompts, steps, BLOCK)
    query_lens = lens
    logits_all, tokens = [], []
    with torch.inference_mode():
        for _ in range(steps + 1):
            meta = AttentionMetadata.build(query_lens, lens, tables, BLOCK, CPU)
            hidden, residual = model(torch.tensor(ids), torch.tensor(positions), kv, meta, backend)
            rows = torch.tensor(query_lens).cumsum(0) - 1
            logits = model.compute_logits(hidden[rows], None if residual is None else residual[rows])
            logits_all.append(logits.clone())
            tokens.append(logits.argmax(-1))
            ids, positions = tokens[-1].tolist(), list(lens)
            lens = [n + 1 for n in lens]
            query_lens = [1] * len(prompts)
    return torch.stack(logits_all), torch.stack(tokens, dim=1)


# --- shard maths, no processes -----------------------------------------------------------------

def _arch(**overrides):
    cfg = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4}
    return arch_from_dict({**cfg, **overrides})


@pytest.mark.parametrize("vocab,tp,ranges", [
    (10, 4, [(0, 3), (3, 6), (6, 9), (9, 10)]),
    (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),     # the last shard is all padding
    (49152, 2, [(0, 24576), (24576, 49152)]),
    (7, 1, [(0, 7)]),
])
def test_vocab_shards_pad_the_last_rank(vocab, tp, ranges):
    assert vocab_shard_size(vocab, tp) == math.ceil(vocab / tp)
    assert [vocab_range(vocab, tp, r) for r in range(tp)] == ranges


def test_shard_sizes():
    sizes = shard_sizes(_arch(vocab_size=1001, intermediate_size=96), tp_rank=1, tp_size=4)
    assert (sizes.num_heads, sizes.num_kv_heads, sizes.intermediate_size) == (2, 1, 24)
    assert (sizes.q_start, sizes.kv_start, sizes.intermediate_start) == (2 * 8, 8, 24)
    assert (sizes.vocab_shard, sizes.vocab_start, sizes.vocab_end) == (251, 251, 502)
    whole = shard_sizes(_arch())
    assert (whole.num_heads, whole.vocab_shard, whole.vocab_rows) == (8, 1000, 1000)


def test_indivisible_layouts_are_config_errors(default_model_dir):
    smol = load_arch(default_model_dir)
    with pytest.raises(ConfigError, match=r"tp=2 .*9 attention heads and 3 kv heads; tp must divide "
                                          r"both: allowed tp = 1, 3$"):
        check_tensor_parallel(smol, 2)
    check_tensor_parallel(smol, 3)
    with pytest.raises(ConfigError, match=r"intermediate size 90 is not divisible by tp: "
                                          r"allowed tp = 1, 2$"):
        check_tensor_parallel(_arch(intermediate_size=90), 4)
    with pytest.raises(ConfigError, match=r"positive integer, got 0"):
        check_tensor_parallel(smol, 0)
    with pytest.raises(ValueError, match=r"tp_rank 2 is outside 0\.\.1"):
        ModelPartition(tp_rank=2, tp_size=2).resolve(4)
    with pytest.raises(ValueError, match=r"rank 1 of 2 needs a TensorParallelGroup"):
        CausalLM(_arch(), 16, ModelPartition(tp_rank=1, tp_size=2))
    with pytest.raises(ConfigError, match=r"9 attention heads"):
        CausalLM(smol, 16, ModelPartition(tp_rank=0, tp_size=2), SimpleNamespace(rank=0, size=2))


def test_single_rank_group_is_an_identity_without_torch_distributed():
    import torch.distributed as dist

    group, t = TensorParallelGroup(), torch.randn(3, 4)
    assert group.all_reduce(t) is t and group.all_gather_last_dim(t) is t
    assert (group.rank, group.size) == (0, 1) and not dist.is_initialized()


def _rank_models(model_dir, arch, tp, dummy):
    return [build_model(model_dir, arch, torch.float32, CPU, 64, ModelPartition(tp_rank=r, tp_size=tp),
                        dummy=dummy, seed=3, tp_group=SimpleNamespace(rank=r, size=tp))
            for r in range(tp)]


@pytest.mark.parametrize("tied", [False, True])
def test_rank_slices_from_safetensors_and_dummy_equal_the_whole_model(tmp_path, tied):
    """Every rank's parameters, from a checkpoint (get_slice) or dummy weights, are its slices of
    the full model's; biases too (Qwen2), and the padded vocab rows are zero."""
    from safetensors.torch import save_file

    cfg = {"model_type": "qwen2", "vocab_size": 1001, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "tie_word_embeddings": tied}
    arch = arch_from_dict(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({n: dummy_tensor(n, s, seed=3) for n, s in hf_tensor_shapes(arch)},
              str(tmp_path / "model.safetensors"))
    whole = build_model(tmp_path, arch, torch.float32, CPU, 64, dummy=True, seed=3)
    whole_params = _dense_params(whole)
    for dummy in (True, False):
        ranks = _rank_models(tmp_path, arch, 2, dummy)
        for r, model in enumerate(ranks):
            sh = model.shard
            for name, param in _dense_params(model).items():
                ref = whole_params[name]
                if "qkv_proj" in name:
                    q, kv = ref.split([arch.q_size, arch.kv_size * 2], 0)
                    k, v = kv.chunk(2, 0)
                    ref = torch.cat([q[sh.q_start:sh.q_start + sh.q_size],
                                     k[sh.kv_start:sh.kv_start + sh.kv_size],
                                     v[sh.kv_start:sh.kv_start + sh.kv_size]])
                elif "gate_up_proj" in name:
                    gate, up = ref.chunk(2, 0)
                    cut = slice(sh.intermediate_start, sh.intermediate_start + sh.intermediate_size)
                    ref = torch.cat([gate[cut], up[cut]])
                elif "o_proj" in name:
                    ref = ref[:, sh.q_start:sh.q_start + sh.q_size]
                elif "down_proj" in name:
                    ref = ref[:, sh.intermediate_start:sh.intermediate_start + sh.intermediate_size]
                elif "embed_tokens" in name or "lm_head" in name:
                    pad = sh.vocab_shard - sh.vocab_rows
                    ref = torch.cat([ref[sh.vocab_start:sh.vocab_end], ref.new_zeros(pad, 64)])
                assert torch.equal(param, ref), (dummy, r, name)


def _dense_params(model):
    """Parameter values by name, the engine's fast linears included (their weight is kept in the
    kernel's layout: oneDNN's packed or the blocked panels)."""
    out = dict(model.named_parameters())
    for name, module in model.named_modules():
        if hasattr(module, "dense_weight"):
            out[f"{name}.weight"] = module.dense_weight()
            if module.bias is not None:
                out[f"{name}.bias"] = module.bias
    return out


# --- TP ranks in processes -------------------------------------------------------------------------

def _tp_worker(rank, world, init_file, out_dir, model_dir, overrides, dummy, prompts, steps, names):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        arch = load_arch(Path(model_dir), overrides)
        group = TensorParallelGroup(dist.group.WORLD)
        model = build_model(Path(model_dir), arch, torch.float32, CPU, 512,
                            ModelPartition(tp_rank=rank, tp_size=world), dummy=dummy, seed=7,
                            tp_group=group)
        results = {}
        for ops, backend in _backends(names):
            model.use_ops(ops)
            results[ops.name] = generate(model, backend, prompts, steps)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run_tp(tmp_path, world, model_dir, overrides, dummy, prompts, steps, names):
    import torch.multiprocessing as mp

    # the spawned children import this module by name (pyproject's pytest `pythonpath`)
    mp.start_processes(_tp_worker, nprocs=world, join=True, start_method="spawn",
                       args=(world, tmp_path / "tp_init", tmp_path, str(model_dir), overrides, dummy,
                             prompts, steps, names))
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _reference(model_dir, overrides, dummy, prompts, steps, names):
    arch = load_arch(Path(model_dir), overrides)
    model = build_model(Path(model_dir), arch, torch.float32, CPU, 512, dummy=dummy, seed=7)
    results = {}
    for ops, backend in _backends(names):
        model.use_ops(ops)
        results[ops.name] = generate(model, backend, prompts, steps)
    return results


def _check_same(ranks, reference, atol):
    for name, (ref_logits, ref_tokens) in reference.items():
        for rank in ranks:
            logits, tokens = rank[name]
            assert logits.shape == ref_logits.shape
            torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=atol)
            assert torch.equal(tokens, ref_tokens), name


@pytest.mark.slow
def test_tp2_dummy_weights_match_single_process(tmp_path, default_model_dir):
    both = ("torch", "native")
    ranks = _run_tp(tmp_path, 2, default_model_dir, TP2_MODEL, True, PROMPTS, DECODE_STEPS, both)
    reference = _reference(default_model_dir, TP2_MODEL, True, PROMPTS, DECODE_STEPS, both)
    assert reference["torch"][0].shape == (DECODE_STEPS + 1, len(PROMPTS), 5001)
    _check_same(ranks, reference, atol=2e-5)


@pytest.mark.slow
def test_tp3_real_weights_match_single_process(tmp_path, default_model_dir):
    """SmolLM2's 9 heads / 3 kv heads / 1536 intermediate split by 3, its real weights read with
    get_slice. To stay fast (three processes share two cores): its first 8 layers, one backend."""
    first_layers = {"num_hidden_layers": 8}
    prompts, steps, names = [list(range(1000, 1012)), [42, 7, 1999]], 3, (_backends()[-1][0].name,)
    ranks = _run_tp(tmp_path, 3, default_model_dir, first_layers, False, prompts, steps, names)
    reference = _reference(default_model_dir, first_layers, False, prompts, steps, names)
    _check_same(ranks, reference, atol=5e-4)
