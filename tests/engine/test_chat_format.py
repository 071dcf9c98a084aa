"""A conversation shaped for its chat template as vLLM 0.32 shapes it (engine/chat_format.py):
content parts for templates that loop over a message's content (Gemma 3's), the developer role
as system where the template has none. The expected values are vLLM 0.32's own
(`vllm.renderers.hf._detect_content_format`, `_convert_developer_to_system` +
`_consolidate_system_messages`), run on these inputs."""
from __future__ import annotations

import pytest

from batchinfer.engine.chat_format import content_format, shape_conversation
from batchinfer.engine.config import ModelConfig
from batchinfer.engine.request import SamplingParams
from batchinfer.engine.tokenizer import load_tokenizer
from batchinfer.runner.io.admission import prompt_token_ids
from batchinfer.runner.io.input_records import parse_plain_or_chat

GEMMA3 = ("{{ bos_token }}{%- for message in messages -%}<start_of_turn>{{ message['role'] }}\n"
          "{% if message['content'] is string -%}{{ message['content'] | trim }}"
          "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
          "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
          "{%- endif -%}<end_of_turn>\n{% endfor -%}"
          "{%- if add_generation_prompt -%}<start_of_turn>model\n{%- endif -%}")
TEMPLATES = {
    "gemma3": (GEMMA3, "openai"),
    "alias": ("{% set msgs = messages[1:] %}{% for m in msgs %}{% for p in m.content %}"
              "{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    "macro": ("{% macro render(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
              "{% for m in messages %}{{ render(m['content']) }}{% endfor %}", "openai"),
    "macro_keyword": ("{% macro render(x, c) %}{% for p in c %}{{ p.text }}{% endfor %}"
                      "{% endmacro %}{% for m in messages %}{{ render(1, c=m.content) }}"
                      "{% endfor %}", "openai"),
    "content_variable": ("{% for message in messages %}{% set content = message['content'] %}"
                         "{% for x in content %}{{ x.text }}{% endfor %}{% endfor %}", "openai"),
    "filtered": ("{% for m in messages|selectattr('role') %}{% for p in m['content']|list %}"
                 "{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    "string": ("{% for m in messages %}{{ m['role'] }}: {{ m.content }}\n{% endfor %}", "string"),
    "broken": ("{% for m in messages %}{{ m.content ", "string"),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_content_format_is_vllms(name):
    template, expected = TEMPLATES[name]
    assert content_format(template) == expected


@pytest.mark.parametrize("conversation, expected", [
    ([{"role": "developer", "content": "Be brief.", "tools": [1]}, {"role": "user", "content": "Hi"}],
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]),
    ([{"role": "system", "content": "S1"}, {"role": "user", "content": "Hi"},
      {"role": "developer", "content": "D2"}, {"role": "assistant", "content": "ok"}],
     [{"role": "system", "content": "S1\n\nD2"}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "ok"}]),
    ([{"role": "user", "content": "Hi"}, {"role": "developer", "content": ""},
      {"role": "developer", "content": "a\nb"}],
     [{"role": "system", "content": "a\nb"}, {"role": "user", "content": "Hi"}]),
])
def test_developer_messages_become_one_leading_system_message_as_vllms(conversation, expected):
    assert shape_conversation(conversation, TEMPLATES["string"][0]) == expected
    named = "{% if m.role == 'developer' %}{% endif %}" + TEMPLATES["string"][0]
    assert shape_conversation(conversation, named) == conversation     # the template has it


def test_a_parts_template_gets_parts_and_a_string_template_the_joined_text(default_model_dir):
    """A line's two text parts: Gemma 3's template runs them together, each trimmed (vLLM hands
    it the parts); SmolLM2's own joins them one a line. A developer turn is system for both."""
    line = {"messages": [{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Name a color. "},
                                                      {"type": "input_text", "text": "One word."}]}]}
    spec = parse_plain_or_chat(line, 1, SamplingParams(max_tokens=8))
    gemma = load_tokenizer(ModelConfig(chat_template=GEMMA3), default_model_dir, "smollm2")
    smol = load_tokenizer(ModelConfig(), default_model_dir, "smollm2")

    def text(tokenizer):
        return tokenizer.hf.decode(prompt_token_ids(spec, tokenizer))

    assert text(gemma) == (f"{gemma.hf.bos_token or ''}<start_of_turn>system\nBe brief.<end_of_turn>\n"
                           "<start_of_turn>user\nName a color.One word.<end_of_turn>\n"
                           "<start_of_turn>model")
    assert "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a color. \nOne word."\
        in text(smol)
