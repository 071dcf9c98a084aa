"""A recipe's own chat template (`model.chat_template`, vLLM's --chat-template: the text, or a
file holding it) and template variables for every chat request (`model.chat_template_kwargs`,
a line's own winning key by key): the prompt ids are those the template renders; a file that is
not there, a broken template and a rendering option given as a variable are refused up front,
naming the key."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from batchinfer.engine.config import ModelConfig
from batchinfer.engine.errors import ModelLoadError
from batchinfer.engine.tokenizer import load_tokenizer

TEMPLATE = ("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
            "{% if add_generation_prompt %}{{ greeting | default('ANSWER') }}:{% endif %}")
HI = [{"role": "user", "content": "hi"}]


def _tokenizer(default_model_dir, **model):
    return load_tokenizer(ModelConfig(**model), default_model_dir, "smollm2")


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.hf.encode(text, add_special_tokens=False))


def test_the_recipes_template_renders_the_prompt(default_model_dir, tmp_path):
    own = _tokenizer(default_model_dir)
    inline = _tokenizer(default_model_dir, chat_template=TEMPLATE)
    assert inline.apply_chat_template(HI) == _ids(own, "<<hi>>ANSWER:")
    assert own.apply_chat_template(HI) != inline.apply_chat_template(HI)    # SmolLM2's own
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    from_file = _tokenizer(default_model_dir, chat_template=str(tmp_path / "t.jinja"))
    assert from_file.apply_chat_template(HI) == inline.apply_chat_template(HI)
    assert from_file.apply_chat_template(HI, add_generation_prompt=False) == _ids(own, "<<hi>>")


def test_template_variables_for_every_request_and_a_lines_own_win(default_model_dir):
    tokenizer = _tokenizer(default_model_dir, chat_template=TEMPLATE,
                           chat_template_kwargs={"greeting": "REPLY"})
    assert tokenizer.apply_chat_template(HI) == _ids(tokenizer, "<<hi>>REPLY:")
    line_own = tokenizer.apply_chat_template(HI, template_kwargs={"greeting": "SAY"})
    assert line_own == _ids(tokenizer, "<<hi>>SAY:")


@pytest.mark.parametrize("model, says", [
    ({"chat_template": "templates/missing.jinja"}, "neither a Jinja template"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "not a template variable"),
])
def test_a_bad_recipe_value_is_refused_naming_the_key(model, says):
    with pytest.raises(ValidationError, match=says) as caught:
        ModelConfig(**model)
    assert next(iter(model)) in str(caught.value)


def test_a_broken_template_is_refused_when_the_tokenizer_loads(default_model_dir, tmp_path):
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}\n{{ m['content'] }}\n")
    with pytest.raises(ModelLoadError, match=r"model.chat_template \(.*bad.jinja\): not a valid "
                                             r"Jinja template: line \d+"):
        _tokenizer(default_model_dir, chat_template=str(tmp_path / "bad.jinja"))
