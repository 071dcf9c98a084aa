"""Greedy outputs equal Hugging Face transformers' generate, token for token (fp32)."""
from __future__ import annotations

import pytest
import torch

from tests.greedy import greedy_tokens

MAX_NEW = 24


def _prompts(tokenizer):
    texts = [
        "Hi",
        "What is the capital of France?",
        "Write a short story about a dragon who learns to bake bread in a small village.",
        "Explain, step by step, how a bill becomes a law in the United States. " * 6,
        "List the planets of the solar system in order from the sun, with one fact about each. "
        + "Be precise and use complete sentences. " * 40,
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    prompts.insert(0, [tokenizer.encode("Hello")[0]])  # a one-token prompt
    lengths = [len(p) for p in prompts]
    assert min(lengths) == 1 and max(lengths) > 200
    return prompts


@pytest.fixture(scope="module")
def hf_reference(default_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
    model.eval()

    answers = {}   # each prompt generated once for the whole module

    def generate(prompt_ids):
        key = tuple(prompt_ids)
        if key not in answers:
            with torch.inference_mode():
                out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_NEW,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
            answers[key] = out[0, len(prompt_ids):].tolist()
        return answers[key]

    return generate


def _run(engine, prompts, batched: bool):
    return greedy_tokens(engine, prompts, batched, MAX_NEW)


@pytest.mark.parametrize("scheduler", [
    {"policy": "sb"},
    {"policy": "hb", "max_num_batched_tokens": 64, "chunk_size": 24},
])
@pytest.mark.slow
def test_greedy_matches_transformers(make_engine, hf_reference, scheduler):
    engine = make_engine(scheduler=scheduler, model={"max_model_len": 1024})
    assert engine.info["attention_backend"] == "native"      # the default on CPU
    prompts = _prompts(engine.tokenizer)
    expected = [hf_reference(p) for p in prompts]
    assert _run(engine, prompts, batched=True) == expected
    assert _run(engine, prompts[:3], batched=False) == expected[:3]


@pytest.mark.slow
def test_torch_attention_backend_matches_native_and_transformers(make_engine, hf_reference):
    """The portable backend gives the tokens the native one gives (test_greedy_matches_transformers
    holds those to transformers' own, which this module generates once): compared with those
    directly, no second engine run is needed."""
    portable = make_engine(model={"max_model_len": 1024}, device={"attention_backend": "torch"})
    assert portable.info["attention_backend"] == "torch"
    prompts = _prompts(portable.tokenizer)
    assert _run(portable, prompts, True) == [hf_reference(p) for p in prompts]


def test_tiny_qwen2_with_qkv_bias_matches_transformers(tmp_path, default_model_dir, make_engine):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # make the biases matter
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    for f in default_model_dir.glob("tokenizer*"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    engine = make_engine(model={"path": str(tmp_path)})
    assert engine.info["model_id"] == str(tmp_path)
    prompts = [[5, 17, 300, 42], list(range(100, 160)), [7]]
    ours = _run(engine, prompts, batched=True)
    for p, got in zip(prompts, ours):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert got == ref
