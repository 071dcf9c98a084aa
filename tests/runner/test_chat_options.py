"""vLLM's chat options on a chat line: add_generation_prompt, continue_final_message and
chat_template_kwargs (a JSONL chat line's own keys, an OpenAI chat body's as vLLM's server
takes them). The expected ids are what vLLM 0.32's LLM.chat gave on SmolLM2-135M-Instruct."""
from __future__ import annotations

import pytest

from batchinfer.engine.config import ModelConfig
from batchinfer.engine.request import SamplingParams
from batchinfer.engine.tokenizer import Tokenizer, load_tokenizer
from batchinfer.runner.io.admission import prompt_token_ids
from batchinfer.runner.io.input_records import InputError, parse_openai, parse_plain_or_chat

DEFAULTS = SamplingParams(max_tokens=8)
ASKED = [{"role": "user", "content": "What is the capital of France?"}]
PREFILLED = ASKED + [{"role": "assistant", "content": "The capital of France is"}]
HEAD = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
        407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198]
CONTINUED = HEAD + [1, 520, 9531, 198, 504, 3575, 282, 4649, 314]     # no <|im_end|> after it


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig())


def _ids(tokenizer, record, chat_template="auto"):
    spec = parse_plain_or_chat(record, 1, DEFAULTS)
    assert not isinstance(spec, InputError), spec.message
    return prompt_token_ids(spec, tokenizer, chat_template)


def test_continue_final_message_leaves_the_last_message_open_as_vllm_does(tokenizer):
    record = {"messages": PREFILLED, "continue_final_message": True,
              "add_generation_prompt": False}
    assert _ids(tokenizer, record) == CONTINUED
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": PREFILLED, "continue_final_message": True,
                     "add_generation_prompt": False}}
    assert prompt_token_ids(parse_openai(line, 1, DEFAULTS), tokenizer) == CONTINUED


def test_add_generation_prompt_false_ends_at_the_last_message(tokenizer):
    assert _ids(tokenizer, {"messages": ASKED, "add_generation_prompt": False}) == HEAD
    assert _ids(tokenizer, {"messages": ASKED, "add_generation_prompt": None}) == HEAD + [
        1, 520, 9531, 198]                                   # null: the default, true
    plain = _ids(tokenizer, {"messages": ASKED, "add_generation_prompt": False}, "never")
    assert tokenizer.decode(plain) == "user: What is the capital of France?"


def test_chat_template_kwargs_are_variables_the_template_reads(default_model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_model_dir))
    hf.chat_template = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
                        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}")
    tok = Tokenizer(hf, "thinking-template")
    quiet = _ids(tok, {"messages": ASKED, "chat_template_kwargs": {"enable_thinking": False}})
    assert tok.decode(quiet).endswith("/no_think")
    assert not tok.decode(_ids(tok, {"messages": ASKED})).endswith("/no_think")


@pytest.mark.parametrize("record,says", [
    ({"messages": PREFILLED, "continue_final_message": True},
     "continue_final_message: true needs add_generation_prompt: false"),
    ({"messages": ASKED, "add_generation_prompt": "no"}, "must be true or false"),
    ({"messages": ASKED, "chat_template_kwargs": ["enable_thinking"]}, "must be an object"),
    ({"messages": ASKED, "chat_template_kwargs": {"add_generation_prompt": False}},
     "set add_generation_prompt on the line itself"),
    ({"messages": ASKED, "chat_template_kwargs": {"tokenize": True}}, "rendering option"),
    ({"prompt": "Hi", "continue_final_message": True}, "applies to a chat request"),
])
def test_a_bad_chat_option_is_the_lines_error_naming_it(record, says):
    parsed = parse_plain_or_chat(record, 3, DEFAULTS)
    assert isinstance(parsed, InputError) and parsed.code == "invalid_chat_options"
    assert says in parsed.message and parsed.line == 3


def test_an_openai_completions_body_takes_no_chat_options():
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "Hi", "add_generation_prompt": False}}
    parsed = parse_openai(line, 1, DEFAULTS)
    assert isinstance(parsed, InputError) and parsed.code == "unknown_key"
    chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": ASKED, "chat_template_kwargs": 3}}
    parsed = parse_openai(chat, 1, DEFAULTS)
    assert parsed.code == "invalid_chat_options" and "body.chat_template_kwargs" in parsed.message
