"""Teacher-forced comparison of our model's next-token log-probs with transformers' on held
texts: what the reduced-precision paths (bf16 weights, int8 linears) are held to."""
from __future__ import annotations

import torch

from benchmarks.common import teacher_forced_logprobs

HELD_TEXTS = [
    "The history of the Roman Empire spans more than a thousand years, from the founding of the "
    "city to the fall of Constantinople.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon "
    "dioxide and water.",
    "Q: How many legs does a spider have?\nA: A spider has eight legs.\nQ: And an insect?\nA:",
]


def hf_logprobs(model_dir, dtypes=(torch.bfloat16, torch.float32)):
    """(token ids of HELD_TEXTS, {dtype: transformers' next-token log-probs per text})."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [tokenizer.encode(t) for t in HELD_TEXTS]
    out = {}
    for dtype in dtypes:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        with torch.inference_mode():
            out[dtype] = [torch.log_softmax(model(torch.tensor([i])).logits[0].float(), -1)
                          for i in ids]
    return ids, out


def teacher_forced(model, backend, arch, ids, kv_dtype=torch.bfloat16,
                   decode_steps: bool = False) -> list[torch.Tensor]:
    """Our model's next-token log-probs at every position of each text (one prefill each, or one
    decode step a token, over a paged cache in kv_dtype)."""
    return [teacher_forced_logprobs(model, backend, arch, seq, kv_dtype, decode_steps)
            for seq in ids]


def agreement(ours, theirs, ids) -> tuple[float, float]:
    """(share of positions whose top-1 token agrees, largest |log-prob difference| of the text's
    actual next token)."""
    agree = total = 0
    worst = 0.0
    for a, b, seq in zip(ours, theirs, ids):
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(seq)
        nxt = torch.tensor(seq[1:])[:, None]
        worst = max(worst, float((a[:-1].gather(1, nxt) - b[:-1].gather(1, nxt)).abs().max()))
    return agree / total, worst
