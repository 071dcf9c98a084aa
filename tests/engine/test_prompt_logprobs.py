"""prompt_logprobs (vLLM's): each prompt token's log-probability given the tokens before it, its
rank and the top k, against transformers running the same model in fp32: one process with
chunked prefill and requests that do not ask beside it, prefix caching on (a cached prefix
drops no position), a recompute after preemption (the first scores are kept, none repeated),
and the pipeline / tensor-parallel workers (the last stage holds the LM head)."""
from __future__ import annotations

import pytest
import torch

from batchinfer.engine.request import SamplingParams

TOP = 5


def _reference(model, prompt: list[int], top: int = TOP) -> list[tuple]:
    """(logprob, rank, top ids) of each prompt token after the first, from transformers."""
    with torch.inference_mode():
        scores = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    out = []
    for pos, token in enumerate(prompt[1:]):
        row = scores[pos]
        out.append((row[token].item(), int((row >= row[token]).sum()),
                    row.topk(top).indices.tolist() if top else []))
    return out


def _check(output, reference, top: int = TOP) -> None:
    entries = output.prompt_logprobs
    assert entries[0] is None and len(entries) == len(output.prompt_token_ids)
    assert [e["token_id"] for e in entries[1:]] == output.prompt_token_ids[1:]
    assert [e["logprob"] for e in entries[1:]] == pytest.approx([r[0] for r in reference],
                                                                abs=2e-4)
    assert [e["rank"] for e in entries[1:]] == [r[1] for r in reference]
    assert [[t["token_id"] for t in e["top_logprobs"]] for e in entries[1:]] == \
        [r[2] for r in reference]
    for entry in entries[1:]:
        assert len(entry["top_logprobs"]) == top
        assert entry["bytes"] and isinstance(entry["token"], str)
        if entry["rank"] == 1 and top:       # the most likely token heads its top list
            assert entry["top_logprobs"][0]["token_id"] == entry["token_id"]


@pytest.fixture(scope="module")
def smollm(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir),
                                                dtype=torch.float32).eval()


def _prompts(tokenizer) -> list[list[int]]:
    texts = ["The capital of France is Paris, and the capital of Germany is Berlin. " * 3,
             "Write a short story about a dragon who learns to bake bread.",
             "def add(a, b):\n    return a + b\n"]
    return [tokenizer.encode(t) for t in texts]


def test_chunked_and_batched_prompt_scores_equal_transformers(make_engine, smollm):
    """Chunks of 24 tokens (the 46-token prompt in two micro-batches: a chunk's last position
    scores the next chunk's first token), beside requests that do not ask; prompt_logprobs 0
    gives the prompt tokens alone; a one-token prompt has only the None."""
    engine = make_engine(model={"max_model_len": 512},
                         scheduler={"policy": "hb", "max_num_batched_tokens": 40,
                                    "chunk_size": 24})
    prompts = _prompts(engine.tokenizer)
    assert len(prompts[0]) > 40
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=TOP),
              SamplingParams(temperature=0, max_tokens=3),
              SamplingParams(temperature=0.8, seed=1, max_tokens=3, prompt_logprobs=0),
              SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)]
    outs = engine.generate(prompts + [prompts[1][:1]], params)
    _check(outs[0], _reference(smollm, prompts[0]))
    assert outs[1].prompt_logprobs is None
    _check(outs[2], _reference(smollm, prompts[2], 0), top=0)
    assert outs[3].prompt_logprobs == [None]
    alone = engine.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert outs[1].output_token_ids == alone.output_token_ids   # its neighbours changed nothing


def test_a_cached_prefix_drops_no_position(make_engine, smollm):
    """With prefix caching on, a request that asks computes its whole prompt (vLLM's
    skip_reading_prefix_cache): the same prompts without it hit the cache."""
    engine = make_engine(model={"max_model_len": 512}, cache={"kv_cache_memory": "64MiB",
                                                              "enable_prefix_caching": True})
    shared = engine.tokenizer.encode("Answer the question in one word, then explain. " * 4)
    assert len(shared) > 2 * engine.scheduler.block_manager.block_size
    first = shared + engine.tokenizer.encode(" What is the tallest mountain?")
    second = shared + engine.tokenizer.encode(" Which river is the longest?")
    engine.generate([first], SamplingParams(temperature=0, max_tokens=2))
    hits = engine.stats()["prefix_cache"]["hit_tokens"]
    out = engine.generate([second], SamplingParams(temperature=0, max_tokens=2,
                                                   prompt_logprobs=TOP))[0]
    _check(out, _reference(smollm, second))
    assert engine.stats()["prefix_cache"]["hit_tokens"] == hits       # read nothing cached
    engine.generate([second], SamplingParams(temperature=0, max_tokens=2))
    assert engine.stats()["prefix_cache"]["hit_tokens"] > hits        # the cache is there


TINY = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir):
    """A random 4-layer Llama with the default tokenizer, its LM head spread (std 1) so the
    top-k has no near-ties: (directory, the transformers model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(vocab_size=49152, max_position_embeddings=512,
                         tie_word_embeddings=False, **TINY)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        hf.lm_head.weight.normal_(0, 1.0)
    hf.save_pretrained(path)
    for f in default_model_dir.glob("tokenizer*"):
        (path / f.name).write_bytes(f.read_bytes())
    return path, hf


def _tiny_prompts() -> list[list[int]]:
    return [list(range(300, 371)), [5, 17, 300, 42, 9, 11], list(range(1000, 1200, 7))]


@pytest.mark.parametrize("parallel", [{"pp": 2}, {"tp": 2}])
def test_pipeline_and_tensor_parallel_workers_score_the_prompt(make_engine, tiny_model,
                                                               parallel):
    """The workers' path: the last stage (every TP rank runs the LM head's all-gather, one
    reports), chunked, beside a request that does not ask."""
    path, hf = tiny_model
    prompts = _tiny_prompts()
    params = [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP),
              SamplingParams(temperature=0, max_tokens=2),
              SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)]
    with make_engine(model={"path": str(path), "max_model_len": 512},
                     cache={"kv_cache_memory": "16MiB"}, parallel=parallel,
                     scheduler={"policy": "hb", "max_num_batched_tokens": 48,
                                "chunk_size": 32}) as engine:
        outs = engine.generate(prompts, params)
    _check(outs[0], _reference(hf, prompts[0]))
    assert outs[1].prompt_logprobs is None
    _check(outs[2], _reference(hf, prompts[2]))


def test_a_recomputed_prompt_keeps_its_first_scores(make_engine, tiny_model):
    """A sequence preempted by recompute prefills its prompt again: its positions are not
    scored twice (as vLLM, the first scores stand)."""
    path, hf = tiny_model
    prompts = [list(range(300 + 40 * i, 340 + 40 * i)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, prompt_logprobs=2)
    engine = make_engine(model={"path": str(path), "max_model_len": 256},
                         cache={"kv_cache_memory": 320 * 1024},   # 320 tokens, 1 KiB each
                         scheduler={"policy": "hb", "max_num_batched_tokens": 64})
    outs = engine.generate(prompts, params)
    assert engine.stats()["num_preemptions"] > 0
    assert any(out.num_preemptions for out in outs)
    for prompt, out in zip(prompts, outs):
        _check(out, _reference(hf, prompt, 2), top=2)


def test_the_range_is_vllms_default_max_logprobs():
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
    for bad in (21, -1, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
