"""The families' new attention paths on CUDA, landed without a GPU: GPT-OSS (attention sinks beside
a 16-key window, biased experts, YaRN), Gemma 2 and Gemma 3 (windowed layers with their own KV
layer groups, which release the blocks behind the window), each with the engine's CUDA defaults
(the Triton kernel; CUDA graphs and async scheduling where the model allows them), in fp32
against transformers' greedy tokens; and the Triton kernel's sinks on CUDA tensors, in a ragged
batch and inside a captured decode graph, against the per-sequence definition.

Skipped without CUDA (CI); a lent GPU machine runs them with benchmarks/engine/cuda_check.sh.
BATCHINFER_TEST_DEVICE=cpu runs the same checks on the CPU (the native kernel in the engine,
Triton's interpreter for the kernel checks, graphs' forward eagerly) to try a change without a
GPU. The models are tests/tiny_families.py's, built by the CPU tests' own fixtures; their
tokenizer comes from BATCHINFER_TEST_TOKENIZER_DIR where the embedded model is not installed.
"""
from __future__ import annotations

import pytest
import torch

from tests.engine import test_cuda_paths as cuda_paths
from tests.engine import test_gpt_oss as gpt_oss_tests
from tests.engine import test_hybrid_window_engine as hybrid_tests
from tests.engine import test_model_families as model_families
from tests.engine.test_cuda_paths import DEVICE
from tests.greedy import greedy_tokens
from tests.kernels.test_attention_sinks import CASES, _case, sink_definition
from tests.tiny_families import PROMPTS, TINY, hf_greedy
from tests.triton_interpreter import DEVICE as KERNEL_DEVICE  # before batchinfer imports triton
from batchinfer.engine.attention import AttentionMetadata  # noqa: E402
from batchinfer.engine.cuda_graphs import DecodeGraphs, GraphDecodeAttention, StaticDecodeMeta  # noqa: E402
from batchinfer.engine.triton_attention import TritonAttention  # noqa: E402
from tests.paged_cases import paged_case  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="torch sees no CUDA device")

ON_CUDA = DEVICE == "cuda"
OSS_NEW = 24                        # GPT-OSS's new tokens: a 1-token prompt decodes past its window

# the CPU tests' fixtures, reused: the tokenizer files (BATCHINFER_TEST_TOKENIZER_DIR or the
# embedded model's), GPT-OSS's tiny model, the hybrid Gemmas with transformers' tokens, and the
# block manager's invariants checked after every release
tokenizer_files = cuda_paths.tokenizer_files
family_dir = gpt_oss_tests.family_dir
hybrid = hybrid_tests.hybrid
checked = hybrid_tests.checked
family_models = model_families.family_models    # family -> (directory, greedy tokens, model)


@pytest.fixture(scope="module")
def default_model_dir(tokenizer_files):
    """Where the reused builders take their tokenizer files from (conftest's fixture needs the
    embedded model, which a GPU machine may not have)."""
    return tokenizer_files[0].parent


def _engine(make_engine, path, cache, scheduler, **device):
    return make_engine(model={"path": str(path), "max_model_len": 256, "dtype": "float32"},
                       device={"device": DEVICE, **device}, cache=cache,
                       scheduler={"max_num_seqs": 16, **scheduler})


# --- GPT-OSS ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_oss(family_dir):
    """(directory, transformers' greedy tokens for PROMPTS, OSS_NEW of them, on the CPU)."""
    path, model = family_dir("gpt_oss")
    return path, hf_greedy(model, PROMPTS, OSS_NEW)


def test_gpt_oss_sinks_and_windows_through_the_triton_kernel_give_transformers_tokens(
        make_engine, gpt_oss):
    """The CUDA defaults for a mixture of experts: the Triton attention with its SINKS and
    WINDOWED switches, the Triton experts (biased, the clamped SwiGLU) and, as they read nothing
    on the host, steps launched ahead; no graphs. Chunked prefill of up to 100-token prompts
    mixed with decode rows, batched and alone."""
    path, expected = gpt_oss
    engine = _engine(make_engine, path, {"kv_cache_memory": "8MiB"},
                     {"policy": "hb", "chunk_size": 16, "max_num_batched_tokens": 48})
    info = engine.info
    assert info["device"].startswith(DEVICE) and info["dtype"] == "float32"
    assert (info["attention_backend"] == "triton") is ON_CUDA
    assert info["cuda_graphs"] is False and info["async_scheduling"] is ON_CUDA
    assert info["moe_kernel"] == ("triton" if ON_CUDA else "cpu")
    assert info["kv_window"] == 16
    assert greedy_tokens(engine, PROMPTS, batched=True, max_new=OSS_NEW) == expected
    alone = [PROMPTS[0], PROMPTS[-1]]                    # 1 and 100 tokens, one at a time
    assert greedy_tokens(engine, alone, batched=False, max_new=OSS_NEW) == [expected[0],
                                                                            expected[-1]]
    assert engine.stats()["kv_window_freed_blocks"] > 0


def test_gpt_oss_through_the_graphs_padded_decode_forward_gives_transformers_tokens(
        make_engine, gpt_oss):
    """The CUDA graphs' decode forward (GraphDecodeAttention: the kernel over static, padded
    tables and work lists, each layer group's own, the sinks per layer) run eagerly on the GPU:
    a mixture of experts is not captured (build_paths.use_cuda_graphs), so its graph is the forward
    uncaptured."""
    path, expected = gpt_oss
    engine = _engine(make_engine, path, {"kv_cache_memory": "8MiB"}, {"policy": "sb"})
    executor = engine.replicas[0].executor
    executor.graphs = DecodeGraphs(executor.model, executor.kv_caches, executor.block_manager,
                                   torch.device(DEVICE), max_batch=8, max_seq_len_to_capture=256,
                                   capture=False, triton_attention=ON_CUDA)
    assert greedy_tokens(engine, PROMPTS, batched=True, max_new=OSS_NEW) == expected
    assert executor.graphs.steps >= OSS_NEW - 1
    assert engine.stats()["kv_window_freed_blocks"] > 0


def test_qwen3_moe_through_the_triton_experts_with_steps_ahead_gives_transformers_tokens(
        make_engine, family_models):
    """A mixture of experts without biases (Qwen3-MoE: a dense first layer, 16 experts of which
    decode steps leave most without a token) on the CUDA defaults: the Triton experts, steps
    launched ahead, each step's expert load read with its ids."""
    from tests.tiny_families import MAX_NEW

    path, expected, _ = family_models("qwen3_moe")
    engine = _engine(make_engine, path, {"kv_cache_memory": "8MiB"},
                     {"policy": "hb", "chunk_size": 16, "max_num_batched_tokens": 48})
    info = engine.info
    assert info["moe_kernel"] == ("triton" if ON_CUDA else "cpu")
    assert info["async_scheduling"] is ON_CUDA and info["cuda_graphs"] is False
    engine.drain_step_events()
    assert greedy_tokens(engine, PROMPTS, batched=True, max_new=MAX_NEW) == expected
    events = engine.drain_step_events()
    assert all(sum(e["expert_tokens"]) == 2 * (e["num_prefill_tokens"] + e["num_decode_tokens"])
               for e in events)


# --- Gemma 2 and Gemma 3: windows and KV layer groups ------------------------------------------

@pytest.mark.parametrize("family", sorted(hybrid_tests.MODELS))
def test_hybrid_windows_with_graphs_and_steps_ahead_give_transformers_tokens(
        make_engine, hybrid, checked, family):
    """The Triton kernel with windows (and Gemma 2's soft-caps), captured decode graphs whose
    layer groups have their own static tables, steps launched ahead; prompts to 80 tokens and 40
    new ones (the window is 16), chunks of 16: the windowed groups release blocks and the tokens
    are transformers', batched and alone."""
    path, expected = hybrid(family)
    engine = _engine(make_engine, path, {"kv_cache_memory": "4MiB",
                                         "block_size": hybrid_tests.BLOCK},
                     {"policy": "hb", "chunk_size": 16, "max_num_batched_tokens": 48})
    info, bm = engine.info, engine.scheduler.block_manager
    assert bm.windows == hybrid_tests.GROUPS[family][0] and info["kv_window"] == hybrid_tests.WINDOW
    assert (info["attention_backend"] == "triton") is ON_CUDA
    assert info["cuda_graphs"] is ON_CUDA and info["async_scheduling"] is ON_CUDA
    prompts, new = hybrid_tests.PROMPTS, hybrid_tests.MAX_NEW
    assert greedy_tokens(engine, prompts, batched=True, max_new=new) == expected
    assert greedy_tokens(engine, prompts[1:3], batched=False, max_new=new) == expected[1:3]
    graphs = engine.replicas[0].executor.graphs
    if ON_CUDA:
        assert graphs.num_graphs == len(graphs.sizes) and graphs.steps >= new - 1
    assert engine.stats()["kv_window_freed_blocks"] > 0 and checked
    bm.check_invariants()


# blocks of each model's pool: a few sequences' worth, above the largest step's need (Gemma 2: 22
# blocks, a page of 2 layers; Gemma 3: 28, three groups of pages of 1 layer)
PRESSURE_BLOCKS = {"gemma2": 24, "gemma3": 32}


@pytest.mark.parametrize("family", sorted(hybrid_tests.MODELS))
def test_kv_pressure_with_hybrid_windows_preempts_and_recomputes_transformers_tokens(
        make_engine, hybrid, checked, family):
    """Eight sequences in a pool of a few: the windowed groups release blocks, sequences are
    preempted and recomputed (the graphs' padding block held throughout), and every token is
    transformers'."""
    path, expected = hybrid(family)
    page = (hybrid_tests.GROUPS[family][1] * 2 * TINY["num_key_value_heads"] * hybrid_tests.BLOCK
            * 16 * 4)                                    # a page's layers' K/V, heads of 16, fp32
    blocks = PRESSURE_BLOCKS[family]
    engine = _engine(make_engine, path, {"kv_cache_memory": str(blocks * page),
                                         "block_size": hybrid_tests.BLOCK},
                     {"policy": "hb", "chunk_size": 16, "max_num_batched_tokens": 64})
    bm = engine.scheduler.block_manager
    assert bm.num_blocks == blocks
    prompts = hybrid_tests.PROMPTS * 2
    assert greedy_tokens(engine, prompts, batched=True, max_new=hybrid_tests.MAX_NEW) == expected * 2
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_window_freed_blocks"] > 0 and checked
    padding = 1 if engine.info["cuda_graphs"] else 0
    assert bm.num_free_blocks == bm.num_blocks - padding
    bm.check_invariants()


# --- the kernel's sinks on CUDA tensors ----------------------------------------------------------

def _kernel_device():
    if ON_CUDA and KERNEL_DEVICE.type != "cuda":
        pytest.skip("torch sees no CUDA device")
    return KERNEL_DEVICE


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_sinks_on_a_ragged_batch_equal_the_definition(name, dtype, atol):
    """test_attention_sinks.py's cases (decode rows and prefill chunks, GQA, head sizes 48 to
    128, blocks of 8 and 16, windows, a soft-cap), the sinks from far below to far above the
    scores; bf16 against the definition over the same bf16 values (the tolerance of
    test_triton_attention.py's narrow dtypes)."""
    device = _kernel_device()
    q, kc, vc, meta, sinks, window, softcap = _case(name)
    q, kc, vc, sinks = (t.to(dtype) for t in (q, kc, vc, sinks))
    expected = sink_definition(q.float(), kc.float(), vc.float(), meta, 0.125, sinks.float(),
                               window, softcap)
    moved = AttentionMetadata.build(meta.query_lens_cpu, meta.seq_lens_cpu,
                                    meta.block_tables.tolist(), kc.shape[2], device)
    got = TritonAttention().attend(q.to(device), kc.to(device), vc.to(device), moved, 0.125,
                                   window, softcap, sinks=sinks.to(device))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), expected, rtol=atol, atol=atol)


def _replayable(forward, device):
    """forward captured in a CUDA graph (warmed up on a side stream, as cuda_graphs.py does)
    -> a function that replays it and returns its output; off CUDA, forward itself."""
    if device.type != "cuda":
        return forward
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()

    def replay():
        graph.replay()
        return out

    return replay


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (16, 0.3)], ids=["full", "window-softcap"])
@pytest.mark.parametrize("triton", [True, False], ids=["triton", "torch"])
def test_a_captured_decode_graph_takes_the_sinks(triton, window, softcap):
    """GraphDecodeAttention (the graphs' decode attention: the Triton kernel over the static work
    list, or torch's masked gather) captured once over static buffers of 8 rows and 16-block
    tables, replayed for two decode batches of other lengths (padding rows on a spare block):
    each replay's rows equal the definition, sinks included."""
    device = _kernel_device()
    heads, kv_heads, dim, block, batch, width = 8, 2, 64, 16, 8, 16
    sinks = torch.linspace(-3.0, 4.0, heads)
    steps = [[1, 90, 17, 130, 33], [200, 3, 64, 65, 16, 47, 100]]
    cases = [paged_case(seed, dim, heads, kv_heads, block, [1] * len(lens), lens)
             for seed, lens in enumerate(steps)]
    pad = max(c[1].shape[0] for c in cases)          # a block no case uses
    kc = torch.zeros(pad + 1, kv_heads, block, dim, device=device)
    vc = torch.zeros_like(kc)
    q = torch.zeros(batch, heads, dim, device=device)
    ints = torch.zeros(5, batch, dtype=torch.long, device=device)     # row 4: sequence lengths
    tables = torch.full((batch, width), pad, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)
    meta = StaticDecodeMeta(ints, tables, block,
                            torch.stack([rows, torch.zeros_like(rows)], 1).to(torch.int32),
                            torch.arange(batch + 1, dtype=torch.int32, device=device))
    attention = GraphDecodeAttention(triton)
    device_sinks = sinks.to(device)

    def forward():
        meta.prepare(masked=not triton)
        return attention.attend(q, kc, vc, meta, 0.125, window, softcap, sinks=device_sinks)

    ints[4] = 1
    replay = _replayable(forward, device)
    for case_q, case_k, case_v, case_meta in cases:
        n = len(case_meta.seq_lens_cpu)
        kc[:case_k.shape[0]], vc[:case_v.shape[0]] = case_k, case_v
        q.zero_()
        q[:n] = case_q * 4
        ints[4] = 1
        ints[4, :n] = case_meta.seq_lens.to(device)
        tables.fill_(pad)
        tables[:n, :case_meta.block_tables.shape[1]] = case_meta.block_tables.to(device)
        got = replay()[:n].cpu()
        expected = sink_definition(case_q * 4, case_k, case_v, case_meta, 0.125, sinks, window,
                                   softcap)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


# --- where a family's CUDA path leaves transformers: attention backend x element-wise ops -------

# windows, sinks and soft-caps, and the plain Llama beside them
ISOLATED = ("gemma2", "gemma3", "gpt_oss", "llama3")


@pytest.mark.parametrize("ops", ["triton", "torch"], ids=["triton-ops", "torch-ops"])
@pytest.mark.parametrize("backend", ["triton", "torch"], ids=["triton-attn", "torch-attn"])
@pytest.mark.parametrize("family", ISOLATED)
def test_each_backend_and_ops_pair_gives_transformers_logits_and_tokens(family_models, family,
                                                                        backend, ops):
    """The model alone (no engine, no graphs, no steps ahead) on the device, fp32: every prompt
    position's logits within 1e-4 of transformers' and greedy tokens equal to its, for each pair
    of attention backend and element-wise ops, so a failure names the part that differs (the
    engine-level tests above only say that something does)."""
    from batchinfer.engine.model.loader import build_model, load_arch
    from batchinfer.engine.model.ops import TorchOps
    from batchinfer.engine.torch_attention import TorchAttention
    from tests.tiny_families import check_against_transformers

    device = torch.device(DEVICE) if backend == "torch" and ops == "torch" else _kernel_device()
    path, expected, hf = family_models(family)
    model = build_model(path, load_arch(path), torch.float32, device, 256)
    if ops == "triton":
        from batchinfer.engine.triton_ops import TritonOps

        model.use_ops(TritonOps)
    else:
        model.use_ops(TorchOps)
    attention = TritonAttention() if backend == "triton" else TorchAttention()
    check_against_transformers(model, attention, hf, expected, device)
