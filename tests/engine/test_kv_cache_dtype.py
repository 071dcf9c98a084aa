"""cache.kv_cache_dtype: K and V stored in bf16 / fp16 under an fp32 model — twice the tokens in the
same memory, the same tokens whichever attention path reads them, on one process or several."""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.kernels import load_native_kernels
from batchinfer.runner.recipe import RecipeError, load_recipe
from batchinfer.engine.request import SamplingParams

PROMPTS = ["Hi", "The capital of France is", "Write a haiku about the sea. " * 6,
           "List three prime numbers:", "Explain photosynthesis to a child. " * 8, "1, 2, 3,"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SMOL = {"model": {"max_model_len": 512}, "scheduler": {"policy": "hb", "chunk_size": 16}}


def _tokens(engine) -> list[list[int]]:
    return [o.output_token_ids for o in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def fp32_tokens(make_engine):
    return _tokens(make_engine(**SMOL, cache={"kv_cache_memory": "64MiB"}))


@pytest.fixture(scope="module")
def default_backend_tokens(make_engine):
    """kv_dtype -> the single process's tokens on a cache of that dtype through the default
    attention backend, generated once for the tests below that compare with them."""
    tokens = {}

    def of(kv_dtype: str) -> list[list[int]]:
        if kv_dtype not in tokens:
            cache = {"kv_cache_memory": "64MiB", "kv_cache_dtype": kv_dtype}
            tokens[kv_dtype] = _tokens(make_engine(**SMOL, cache=cache))
        return tokens[kv_dtype]

    return of


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_a_narrow_cache_holds_twice_the_tokens_in_the_same_memory(make_engine, tiny_engine_config,
                                                                  kv_dtype):
    model = tiny_engine_config["model"]
    auto = make_engine(model=model, cache={"kv_cache_memory": "16MiB"})
    narrow = make_engine(model=model, cache={"kv_cache_memory": "16MiB", "kv_cache_dtype": kv_dtype})
    assert narrow.info["kv_cache_dtype"] == kv_dtype and auto.info["kv_cache_dtype"] == "float32"
    assert narrow.info["dtype"] == "float32"                     # the model stays fp32
    blocks = narrow.replicas[0].scheduler.block_manager.num_blocks
    assert blocks == 2 * auto.replicas[0].scheduler.block_manager.num_blocks
    key_cache, _ = narrow.replicas[0].executor.kv_caches[0]
    assert key_cache.dtype == getattr(torch, kv_dtype)


@pytest.mark.skipif(not load_native_kernels(), reason="native kernels did not build")
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
@pytest.mark.slow
def test_native_and_torch_attention_agree_on_a_narrow_cache(make_engine, fp32_tokens,
                                                            default_backend_tokens, kv_dtype):
    """Both paths round K/V the same way on write and widen them on read: the same greedy tokens,
    through chunked prefill and decode. Against the fp32 cache the rounding shows, but only as
    late divergence: most replies keep the fp32 reply's first tokens."""
    cache = {"kv_cache_memory": "64MiB", "kv_cache_dtype": kv_dtype}
    native = default_backend_tokens(kv_dtype)     # native: the kernels built (skipif above)
    portable = _tokens(make_engine(**SMOL, cache=cache, device={"attention_backend": "torch"}))
    assert native == portable
    same_start = sum(n[:6] == f[:6] for n, f in zip(native, fp32_tokens))
    assert same_start >= len(PROMPTS) - 1, (native, fp32_tokens)


@pytest.mark.slow
def test_pipeline_ranks_store_the_narrow_dtype(make_engine, default_backend_tokens):
    """Worker processes allocate their caches in kv_cache_dtype: two pipeline stages give the
    single process's tokens."""
    cache = {"kv_cache_memory": "64MiB", "kv_cache_dtype": "bfloat16"}
    expected = default_backend_tokens("bfloat16")
    with make_engine(**SMOL, cache=cache, parallel={"pp": 2}) as engine:
        assert engine.info["kv_cache_dtype"] == "bfloat16"
        assert _tokens(engine) == expected


def test_unknown_kv_cache_dtype_names_the_key_and_what_is_allowed(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("memory:\n  kv_cache_dtype: fp8\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert str(path) in str(info.value)
    assert any("memory.kv_cache_dtype" in p and "'auto', 'bfloat16' or 'float16'" in p
               for p in info.value.problems), info.value.problems
