"""Tiny PEFT LoRA adapters on the tiny families' models (tests/tiny_families.py), and
transformers + peft's greedy tokens with each: the reference the engine's multi-LoRA batches
must equal token for token.

Adapters are made by peft itself (LoraConfig with init_lora_weights=False: A and B both drawn,
so the adapter changes the tokens from the first one), seeded, saved as PEFT directories
(adapter_config.json + adapter_model.safetensors).
"""
from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_families import hf_model, save_model

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Phi-3 checkpoints fuse q/k/v and gate/up: its adapters target the fused modules
TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
# adapter name -> (rank, lora_alpha, use_rslora, seed)
ADAPTERS = {"alpha": (4, 8, False, 1), "beta": (8, 16, True, 2)}
PROMPTS = [[5, 17, 300, 42, 9, 77, 31], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
MAX_NEW = 6


def make_adapter(base, directory: Path, rank: int, alpha: int, rslora: bool, seed: int,
                 targets=None, **config) -> Path:
    """A peft LoRA adapter over `base` (left unchanged), its A and B drawn from `seed` (B
    scaled up: peft's non-default init draws it small), saved in `directory`; `config`: more
    LoraConfig fields (rank_pattern, ...)."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora,
                        target_modules=targets or ALL_LINEARS, init_lora_weights=False,
                        lora_dropout=0.0, **config)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                param.normal_(0.0, 0.3)
    peft_model.save_pretrained(directory)
    return directory


def peft_greedy(base, adapter_dir: Path, prompts, max_new: int = MAX_NEW) -> list[list[int]]:
    """transformers + peft generate with the saved adapter, greedy, one prompt at a time."""
    import copy

    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir)).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(input_ids=torch.tensor([p]), max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def base_greedy(base, prompts, max_new: int = MAX_NEW) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = base.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def lora_family(root: Path, tokenizer_dir: Path, family: str = "llama3", prompts=PROMPTS,
                max_new: int = MAX_NEW, **changes) -> dict:
    """The family's tiny model saved under root/base, ADAPTERS saved under root/<name>, and
    the reference tokens: {"base": path, "adapters": {name: path}, "expected": {None | name:
    [tokens per prompt]}}."""
    base = hf_model(family, **changes)
    path = save_model(base, root / "base", tokenizer_dir)
    adapters, expected = {}, {None: base_greedy(base, prompts, max_new)}
    for name, (rank, alpha, rslora, seed) in ADAPTERS.items():
        adapters[name] = make_adapter(base, root / name, rank, alpha, rslora, seed,
                                      TARGETS.get(family))
        expected[name] = peft_greedy(base, adapters[name], prompts, max_new)
    return {"base": path, "adapters": adapters, "expected": expected}


def run_to_completion(engine, requests) -> dict:
    """Every request added, the engine stepped until idle: request id -> output token ids."""
    for request in requests:
        engine.add_request(request)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out.output_token_ids
    return done
