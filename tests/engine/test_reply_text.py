"""A reply's text and stop strings as vLLM's detokenizer gives them for the same token ids.

The expected values are what vLLM 0.32's own detokenizer (vllm.v1.engine.detokenizer, driven
one token a step as its output processor drives it) gave for these ids.
"""
from __future__ import annotations

import pytest

from batchinfer.engine.config import ModelConfig
from batchinfer.engine.output import OutputProcessor
from batchinfer.engine.request import Request, SamplingParams, Sequence
from batchinfer.engine.tokenizer import Tokenizer, load_tokenizer


def _reply(tok: Tokenizer, prompt: list[int], output: list[int], **params):
    """The engine's OutputProcessor fed `output` one token a step, as the engine feeds it."""
    processor = OutputProcessor(tok, max_model_len=10_000)
    seq = Sequence(Request("r", prompt, SamplingParams(temperature=0, **params)))
    for token in output:
        if processor.append(seq, token, None):
            break
    assert seq.finish_reason is not None, "the reply did not finish"
    return processor.result(seq)


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer(ModelConfig())


@pytest.fixture(scope="module")
def sentencepiece():
    """Llama 2 / Mistral style: "▁" spaces, byte-fallback pieces, and a decoder that strips the
    text's first space (decode([▁Paris]) is "Paris")."""
    from tokenizers import Tokenizer as Backend, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁Paris": 3, "▁is": 4, ".": 5, "▁": 6,
             **{f"<0x{b:02X}>": 7 + b for b in range(256)}}
    backend = Backend(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>")
    return Tokenizer(hf, "sentencepiece-style")


def test_a_stop_string_in_the_first_min_tokens_tokens_text_does_not_stop_the_reply(smol):
    """vLLM checks stop strings only in the text of tokens after the first min_tokens: the
    min_tokens-th token's own text cannot stop the reply (it did here, a token early)."""
    prompt = smol.hf.encode("<|im_start|>user\nSay it<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)
    said = smol.hf.encode(" Hello, world! How are you ?", add_special_tokens=False)
    end = smol.hf.convert_tokens_to_ids("<|im_end|>")
    first = _reply(smol, prompt, said + [end], stop=[" Hello"], min_tokens=1)
    assert (first.text, first.stop_reason) == (" Hello, world! How are you ?", None)
    third = _reply(smol, prompt, said + [end], stop=[" world", "!"], min_tokens=3)
    assert (third.text, third.stop_reason) == (" Hello, world", "!")
    kept = _reply(smol, prompt, said + [end], stop=["How are", "o"], min_tokens=3,
                  include_stop_str_in_output=True)
    assert (kept.text, kept.stop_reason) == (" Hello, world! Ho", "o")
    unbounded = _reply(smol, prompt, said + [end], stop=[" world", "!"])
    assert (unbounded.text, unbounded.stop_reason) == (" Hello,", " world")


def test_a_sentencepiece_reply_keeps_its_first_words_leading_space(sentencepiece):
    """vLLM's detokenizer starts from the prompt's ids, so a reply whose first token is "▁Paris"
    reads " Paris" (decode alone strips the space), in the text and for stop strings alike."""
    prompt, eos = [1, 3, 4], 2
    assert _reply(sentencepiece, prompt, [3, 5, eos]).text == " Paris."
    assert _reply(sentencepiece, prompt, [6, 3, 5, eos]).text == "  Paris."
    assert _reply(sentencepiece, [1], [3, 5, eos]).text == "Paris."   # nothing before it
    cut = _reply(sentencepiece, prompt, [3, 5, eos], stop=[" Paris"],
                 include_stop_str_in_output=True)
    assert (cut.text, cut.stop_reason, cut.output_token_ids) == (" Paris", " Paris", [3])
    rih = [7 + b for b in "日".encode("utf-8")]
    long = _reply(sentencepiece, prompt, [3] + rih[:2], max_tokens=3)
    assert long.text == " Paris"                 # cut inside "日": its bytes give no text


def test_a_prompt_of_ids_ending_inside_a_character_gives_back_only_the_replys_text(
        sentencepiece, smol):
    """A token-id prompt may end with the first bytes of a character its reply finishes: the
    text starts with that character, not (as vLLM's stream gives it) with the whole prompt."""
    rih = [7 + b for b in "日".encode("utf-8")]
    assert _reply(sentencepiece, [1, 3, rih[0]], rih[1:] + [5, 2]).text == "日."
    ids = smol.hf.encode("hi 🐶🐶 ok", add_special_tokens=False)
    inside = next(n for n in range(1, len(ids)) if smol.decode(ids[:n]).endswith("\ufffd"))
    reply = _reply(smol, ids[:inside], ids[inside:], max_tokens=len(ids) - inside)
    assert reply.text == " 🐶🐶 ok"


def test_a_long_prompt_primes_the_detokenizer_with_its_tail_unless_that_gives_no_text(
        sentencepiece):
    """Only the prompt's last ids prime the stream (decoding a long prompt whole costs time on
    every request); where those are all skipped special tokens the whole prompt does, or the
    reply would lose its first space again."""
    from batchinfer.engine.tokenizer import PRIMING_TOKENS

    long_text = [3, 4] * PRIMING_TOKENS
    assert _reply(sentencepiece, long_text, [3, 5, 2]).text == " Paris."
    after_specials = [3, 4] + [1] * (PRIMING_TOKENS + 6)
    assert _reply(sentencepiece, after_specials, [3, 5, 2]).text == " Paris."
    assert _reply(sentencepiece, [1] * (PRIMING_TOKENS + 6), [3, 5, 2]).text == "Paris."
