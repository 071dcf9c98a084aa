"""Prompt token ids as vLLM builds them for the same request, for every input shape.

The expected ids are what vLLM 0.32 (LLM.generate / LLM.chat on SmolLM2-135M-Instruct, the
embedded default's tokenizer) gave for these requests.
"""
from __future__ import annotations

import pytest

from batchinfer.engine.config import ModelConfig
from batchinfer.engine.request import SamplingParams
from batchinfer.engine.tokenizer import load_tokenizer
from batchinfer.runner.io.admission import prompt_token_ids
from batchinfer.runner.io.input_records import parse_openai, parse_plain_or_chat

DEFAULTS = SamplingParams(max_tokens=8)
TWO_PARTS = [{"type": "text", "text": "Name a color."}, {"type": "text", "text": "One word."}]
TWO_PARTS_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28,
                 7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 5820, 253, 2380, 30, 198,
                 2705, 2229, 30, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig())


@pytest.mark.parametrize("record,ids", [
    ({"prompt": "Hello world"}, [19556, 905]),                               # no BOS, as vLLM
    ({"prompt": "café 😀 中文 naïve"}, [83, 1939, 2756, 40303, 218, 216, 28589, 29184, 15486,
                                       46494]),
    ({"prompt": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"},   # special tokens
     [1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198]),
    ({"prompt": [1, 4093, 198, 19556, 2]}, [1, 4093, 198, 19556, 2]),
    ({"messages": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "What is the capital of France?"},
                   {"role": "assistant", "content": "Paris."},
                   {"role": "user", "content": "And Spain?"}]},
     [1, 9690, 198, 6077, 5453, 30, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2,
      198, 1, 520, 9531, 198, 38634, 30, 2, 198, 1, 4093, 198, 3528, 7476, 47, 2, 198, 1, 520,
      9531, 198]),
    ({"messages": [{"role": "user", "content": TWO_PARTS}]}, TWO_PARTS_IDS),
])
def test_a_lines_prompt_ids_are_vllms(tokenizer, record, ids):
    spec = parse_plain_or_chat(record, 1, DEFAULTS)
    assert prompt_token_ids(spec, tokenizer) == ids


def test_text_content_parts_are_joined_one_a_line_as_vllm_joins_them(tokenizer):
    """vLLM joins a message's text parts with a newline for a template that takes a string (it
    took "Name a color.One word.", two sentences run together)."""
    spec = parse_plain_or_chat({"messages": [{"role": "user", "content": TWO_PARTS}]}, 1,
                               DEFAULTS)
    assert spec.messages == [{"role": "user", "content": "Name a color.\nOne word."}]
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": TWO_PARTS}]}}
    assert prompt_token_ids(parse_openai(line, 1, DEFAULTS), tokenizer) == TWO_PARTS_IDS


def test_text_parts_of_every_kind_vllm_reads_and_null_content(tokenizer):
    """vLLM 0.32 reads the Responses API's input_text / output_text parts, plain strings, refusal
    and thinking parts as text, skips empty ones, and reads an assistant's content null (a turn
    that only called tools) as empty: each was refused here. A user turn still needs content."""
    parts = [{"type": "input_text", "text": "Name a color."}, {"type": "text", "text": ""},
             {"type": "text", "text": None}, "One word."]
    spec = parse_plain_or_chat({"messages": [{"role": "user", "content": parts}]}, 1, DEFAULTS)
    assert spec.messages == [{"role": "user", "content": "Name a color.\nOne word."}]
    assert prompt_token_ids(spec, tokenizer) == TWO_PARTS_IDS
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    spec = parse_plain_or_chat({"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."},
                                          {"type": "output_text", "text": "Sorry."}]}]}, 1, DEFAULTS)
    assert spec.messages[1] == {"role": "assistant", "content": "", "tool_calls": calls}
    assert spec.messages[2] == {"role": "assistant", "content": "No.\nSorry."}
    for bad in ([{"type": "image_url", "image_url": {"url": "x"}}], [{"type": "text", "text": 3}],
                [7], 5, None):
        parsed = parse_plain_or_chat({"messages": [{"role": "user", "content": bad}]}, 2, DEFAULTS)
        assert parsed.code == "invalid_messages" and "messages[0].content" in parsed.message


def test_vllms_prompt_token_ids_key_is_pointed_to_prompt():
    """A vLLM TokensPrompt line ({"prompt_token_ids": [...]}) was told "did you mean
    'stop_token_ids'?"."""
    parsed = parse_plain_or_chat({"id": "t", "prompt_token_ids": [1, 2, 3]}, 4, DEFAULTS)
    assert parsed.code == "unknown_key" and parsed.line == 4
    assert "give the token ids as 'prompt'" in parsed.message
    assert "stop_token_ids" not in parsed.message
