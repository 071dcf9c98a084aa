"""Loading tokenizers: the class AutoTokenizer would pick, once per source and version."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from batchinfer.engine.config import ModelConfig
from batchinfer.engine.tokenizer import _class_deciding_config, load_tokenizer

TEXT = "Hello <|im_start|> wörld,\tnumbers 12345 and   spaces<|im_end|>"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def _copy(src, dst, edit_config=None, edit_tokenizer_config=None):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    for name, edit in (("config.json", edit_config), ("tokenizer_config.json",
                                                      edit_tokenizer_config)):
        if edit is not None:
            data = json.loads((dst / name).read_text())
            edit(data)
            (dst / name).write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize("variant", ["as-shipped", "qwen2-type", "class-unnamed"])
def test_the_tokenizer_is_the_one_auto_tokenizer_picks(tmp_path, default_model_dir, variant):
    from transformers import AutoTokenizer

    edits = {"as-shipped": {},
             "qwen2-type": {"edit_config": lambda c: c.update(model_type="qwen2")},
             "class-unnamed": {"edit_tokenizer_config": lambda t: t.pop("tokenizer_class")}}
    source = _copy(default_model_dir, tmp_path / variant, **edits[variant])
    light = _class_deciding_config(source)
    assert (light is None) == (variant == "class-unnamed")   # then AutoTokenizer reads the config
    ours = load_tokenizer(ModelConfig(), model_dir=source, model_id="m").hf
    theirs = AutoTokenizer.from_pretrained(str(source))
    assert type(ours) is type(theirs)
    assert ours.encode(TEXT) == theirs.encode(TEXT)
    assert ours.apply_chat_template(CHAT, tokenize=False) == theirs.apply_chat_template(
        CHAT, tokenize=False)
    assert ours.eos_token_id == theirs.eos_token_id and len(ours) == len(theirs)


def test_a_tokenizer_is_loaded_once_per_version(tmp_path, default_model_dir):
    source = _copy(default_model_dir, tmp_path / "m")
    first = load_tokenizer(ModelConfig(), model_dir=source, model_id="m").hf
    assert load_tokenizer(ModelConfig(), model_dir=source, model_id="m").hf is first
    path = source / "tokenizer_config.json"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))   # a new version
    assert load_tokenizer(ModelConfig(), model_dir=source, model_id="m").hf is not first


def test_a_config_only_folder_with_dummy_weights_takes_the_embedded_tokenizer(caplog):
    """examples/model-configs/ hold a config.json alone: real shapes, random weights."""
    import logging
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "examples/model-configs/llama-3.1-8b"
    with caplog.at_level(logging.WARNING, logger="batchinfer.engine.tokenizer"):
        tok = load_tokenizer(ModelConfig(path=str(folder), load_format="dummy"))
    assert tok.encode("hello world") and "embedded" in caplog.text
    with pytest.raises(Exception, match="model.path: .* holds no tokenizer files"):
        load_tokenizer(ModelConfig(path=str(folder)))       # real weights need their tokenizer


def test_a_byte_level_tokens_text_and_bytes_are_what_it_stands_for():
    """Log-probability entries show " there", not the vocabulary's "Ġthere", and a character
    split over tokens keeps its bytes (OpenAI's logprobs `bytes`), so joining them gives the
    text back."""
    from batchinfer.engine.tokenizer import Tokenizer

    tok = load_tokenizer(ModelConfig())
    text = " there’s naïve 日本"
    ids = tok.hf.encode(text)
    assert tok.hf.convert_ids_to_tokens(ids[0]) == "Ġthere"
    assert tok.token_text(ids[0]) == " there" and tok.token_bytes(ids[0]) == b" there"
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    split = [i for i in ids if len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80]
    assert split and all(tok.token_text(i) == "\ufffd" for i in split)
    end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.token_text(end) == "<|im_end|>"
    assert isinstance(tok, Tokenizer)


def test_a_reply_cut_inside_a_character_ends_before_it_as_vllms_text_does():
    """max_tokens can stop a reply after the first byte token of an emoji: decode showed a
    trailing U+FFFD that vLLM's incremental detokenizer never gives out."""
    tok = load_tokenizer(ModelConfig())
    ids = tok.hf.encode(" dog 🐶🐶", add_special_tokens=False)
    whole = tok.decode(ids)
    assert tok.decode_reply(ids) == whole == " dog 🐶🐶"
    cut = next(n for n in range(len(ids) - 1, 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    assert tok.decode(ids[:cut]).endswith("\ufffd")
    assert tok.decode_reply(ids[:cut]) == " dog 🐶"
    assert tok.decode_reply(ids[:1]) == tok.decode(ids[:1])         # nothing held back
    end = tok.hf.convert_tokens_to_ids("<|im_end|>")                # a skipped special token
    assert tok.decode_reply(ids[:cut] + [end]) == " dog 🐶"
    assert tok.decode_reply(ids[:cut] + [end], skip_special_tokens=False) == tok.decode(
        ids[:cut] + [end], skip_special_tokens=False)


def test_a_sentencepiece_tokens_text_and_bytes_replace_the_space_marker_and_read_byte_pieces():
    """Llama / Gemma style: "▁there" is " there"; a byte-fallback piece "<0xE6>" is that byte."""
    from tokenizers import Tokenizer as Backend, decoders, models
    from transformers import PreTrainedTokenizerFast

    from batchinfer.engine.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁there": 3, "s": 4,
             **{f"<0x{b:02X}>": 5 + b for b in range(256)}}
    backend = Backend(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>")
    tok = Tokenizer(hf, "sentencepiece-style")
    assert tok.token_text(3) == " there" and tok.token_bytes(3) == b" there"
    pieces = [5 + b for b in "日".encode("utf-8")]
    assert b"".join(tok.token_bytes(i) for i in pieces) == "日".encode("utf-8")
    assert tok.token_text(pieces[0]) == "\ufffd"
    assert tok.token_text(2) == "</s>"
    assert tok.decode([3] + pieces[:2]).endswith("\ufffd")     # byte pieces of an unfinished "日"
    assert tok.decode_reply([3] + pieces[:2]) == tok.decode([3]) == "there"
    assert tok.decode_reply([3] + pieces) == "there日"


def test_a_tokenizer_folder_transformers_can_load_is_loaded(tmp_path):
    """Not only tokenizer.json / tokenizer.model: a GPT-2 style folder (vocab.json and
    merges.txt, the model type in config.json) loads as transformers loads it; a folder without
    a tokenizer's files says so (not a tokenizer transformers builds empty from config.json)."""
    import json

    from batchinfer.engine.config import ModelConfig
    from batchinfer.engine.errors import ModelLoadError
    from batchinfer.engine.model.sources import resolve_model_dir
    from batchinfer.engine.tokenizer import load_tokenizer

    embedded = json.loads((resolve_model_dir(None)[0] / "tokenizer.json").read_text())["model"]
    (tmp_path / "vocab.json").write_text(json.dumps(embedded["vocab"]))
    merges = [" ".join(m) if isinstance(m, list) else m for m in embedded["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    reference = load_tokenizer(ModelConfig())
    assert load_tokenizer(ModelConfig(tokenizer=str(tmp_path))).encode("hello world") == \
        reference.encode("hello world")
    # a config.json alone: transformers would build an empty Qwen2 tokenizer from it
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ModelLoadError, match="model.tokenizer: .*empty' holds no tokenizer files"):
        load_tokenizer(ModelConfig(tokenizer=str(tmp_path / "empty")))


def test_a_tokenizer_larger_than_the_models_vocabulary_is_warned_of_once(caplog, tmp_path,
                                                                        default_model_dir):
    """Another model's tokenizer: said up front with both sizes, not only as 'prompt token ids
    out of range' on each prompt whose text reaches past the model's rows."""
    import logging

    from batchinfer.engine.build import model_source

    config = json.loads((default_model_dir / "config.json").read_text())
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    with caplog.at_level(logging.WARNING, logger="batchinfer.engine.tokenizer"):
        model_source(ModelConfig(path=str(small), load_format="dummy",
                                 tokenizer=str(default_model_dir)))
    assert "model.tokenizer: the tokenizer has 49152 tokens but the model's vocabulary is 1000" \
        in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="batchinfer.engine.tokenizer"):
        model_source(ModelConfig(path=str(default_model_dir)))
    assert "vocabulary" not in caplog.text
