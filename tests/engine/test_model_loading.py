"""Model sources and the errors bad ones give: each names the file and what was expected."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.errors import ConfigError, ModelLoadError
from batchinfer.engine.model.sources import gguf_to_hf_dir, resolve_model_dir


def _copy_model(src, dst, weights=True):
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors" and not weights:
            continue
        shutil.copy(f, dst / f.name)
    return dst


def _build(path, **model):
    from batchinfer.engine.engine import Engine

    return Engine.from_config(EngineConfig(model={"path": str(path), **model},
                                           cache={"kv_cache_memory": "64MiB"}))


def test_unknown_architecture(tmp_path, default_model_dir):
    d = _copy_model(default_model_dir, tmp_path / "m", weights=False)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config.json: model_type .gpt_neox.*supported: .*llama \("):
        _build(d)


def test_missing_weights(tmp_path, default_model_dir):
    d = _copy_model(default_model_dir, tmp_path / "m", weights=False)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weight files"):
        _build(d)


def test_corrupt_weights(tmp_path, default_model_dir):
    d = _copy_model(default_model_dir, tmp_path / "m", weights=False)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match=r"model.safetensors: cannot read weights"):
        _build(d)


def test_weights_missing_a_tensor(tmp_path, default_model_dir):
    from safetensors.torch import load_file, save_file

    d = _copy_model(default_model_dir, tmp_path / "m", weights=False)
    tensors = load_file(str(default_model_dir / "model.safetensors"))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor\(s\) .*'model\.layers\.3\.mlp\.up_proj"
                                             r"\.weight' \(1536, 576\)$"):
        _build(d)


def test_not_a_gguf_file(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelLoadError, match=r"model.gguf: not a GGUF file"):
        gguf_to_hf_dir(bogus)


def test_missing_path():
    with pytest.raises(ModelLoadError, match=r"does not exist"):
        resolve_model_dir("/nonexistent/model")


def test_heads_must_divide_kv_heads(tmp_path, default_model_dir):
    with pytest.raises(ModelLoadError, match=r"num_attention_heads \(9\) is not a multiple of "
                                             r"num_key_value_heads \(2\)"):
        _build(default_model_dir, load_format="dummy", hf_overrides={"num_key_value_heads": 2})


def test_max_model_len_beyond_the_model(default_model_dir):
    with pytest.raises(ConfigError, match=r"max_model_len 100000 exceeds"):
        _build(default_model_dir, max_model_len=100000)


def test_kv_budget_too_small_for_max_model_len(default_model_dir):
    from batchinfer.engine.engine import Engine

    with pytest.raises(ConfigError, match=r"KV cache holds \d+ tokens, less than max_model_len"):
        Engine.from_config(EngineConfig(model={"path": str(default_model_dir)},
                                        cache={"kv_cache_memory": "8MiB"}))


def test_weights_larger_than_the_hosts_memory_are_refused_before_loading(monkeypatch):
    """Llama 3.1 8B's shipped config in fp32 (30 GiB) on a host with 20 GiB available: a
    ConfigError (exit 2) with the sizes and what to change, before a byte is allocated (it was
    an allocator traceback, exit 3, or the OOM killer); the multi-process build counts one copy
    per data-parallel replica."""
    from pathlib import Path

    from batchinfer.engine import build
    from batchinfer.engine.engine import Engine
    from batchinfer.engine.runtime.build import model_setup

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(build, "available_memory", lambda device: 20 * 2**30)
    monkeypatch.setattr(build, "build_model", no_load)
    folder = Path(__file__).resolve().parents[2] / "examples/model-configs/llama-3.1-8b"
    model = {"path": str(folder), "load_format": "dummy", "max_model_len": 256}
    with pytest.raises(ConfigError, match=r"29\.9 GiB \(8\.03 B parameters in float32\).*"
                                          r"20\.0 GiB.*model\.dtype: bfloat16"):
        Engine.from_config(EngineConfig(model=model))
    half = {**model, "dtype": "bfloat16", "hf_overrides": {"num_hidden_layers": 24}}
    with pytest.raises(ConfigError, match=r"x 2 replicas \(parallel\.dp\).*fewer replicas"):
        model_setup(EngineConfig(model=half, parallel={"dp": 2}))
    setup = model_setup(EngineConfig(model=half, parallel={"dp": 1}))
    assert setup.arch.num_layers == 24


def test_gguf_cache_is_reused(default_model_dir):
    from batchinfer.engine.model.sources import default_model_gguf

    again = gguf_to_hf_dir(default_model_gguf())
    assert again == default_model_dir and (again / "model.safetensors").is_file()


def test_a_file_is_hashed_once_per_version(tmp_path, monkeypatch):
    """The GGUF's digest is kept under the cache by path, inode, size and mtime: a second run
    reads it; a changed file (or a damaged memo) is hashed again."""
    import hashlib
    import os

    from batchinfer.engine.model import sources

    monkeypatch.setenv("BATCHINFER_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(1000))
    expected = hashlib.sha256(path.read_bytes()).hexdigest()
    assert sources._sha256(path) == expected
    memos = list((tmp_path / "cache" / "gguf" / "digests").iterdir())
    assert [m.read_text() for m in memos] == [expected]

    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: reads.append(p) or real_open(p, *a, **k))
    assert sources._sha256(path) == expected and path not in reads     # the memo, not the file
    monkeypatch.undo()
    monkeypatch.setenv("BATCHINFER_CACHE", str(tmp_path / "cache"))

    memos[0].write_text("not a digest")
    assert sources._sha256(path) == expected and memos[0].read_text() == expected
    path.write_bytes(b"GGUF" + bytes(1001))
    os.utime(path, ns=(1, 1))
    assert sources._sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_conversion_parses_its_gguf_once_and_leaves_gguf_as_it_was(tmp_path):
    """Inside the conversion transformers' three opens of the file get one reader and the tensor
    name map is built once per (architecture, layers); outside it, gguf is untouched."""
    import gguf

    from batchinfer.engine.model.sources import _gguf_parsed_once

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first
        assert first.tensors[0].name == "token_embd.weight"
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
    assert gguf.GGUFReader(path) is not first


def test_unsupported_architecture_lists_the_supported_and_the_vllm_route():
    from batchinfer.engine.model.arch import arch_from_dict

    with pytest.raises(ModelLoadError) as info:
        arch_from_dict({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}, "c.json")
    message = str(info.value)
    assert message.startswith("c.json: model_type 'gpt_neox' (architectures ['GPTNeoXForCausalLM'])")
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3"):
        assert f"{model_type} (" in message
    assert "strategy: {name: vllm}" in message


TINY_QWEN3 = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8}


def _tiny_checkpoint(path, cfg, edit):
    """A dummy-weight checkpoint of `cfg` with `edit(tensors)` applied."""
    from safetensors.torch import save_file

    from batchinfer.engine.model.arch import arch_from_dict
    from batchinfer.engine.model.loader import dummy_tensor, hf_tensor_shapes

    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = {n: dummy_tensor(n, s, seed=1) for n, s in hf_tensor_shapes(arch_from_dict(cfg))}
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _load(path):
    import torch

    from batchinfer.engine.model.loader import build_model, load_arch

    return build_model(path, load_arch(path), torch.float32, torch.device("cpu"), 64)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"),
     r"missing 1 tensor\(s\) .*'model\.layers\.1\.self_attn\.k_norm\.weight' \(8,\)$"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)}),
     r"tensor 'model\.layers\.0\.self_attn\.o_proj\.bias' of shape \(32,\) that a qwen3 model"),
    (lambda t: t.update({"model.layers.1.mlp.down_proj.weight": np.zeros((32, 40), np.float32)}),
     r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight' has shape \(32, 40\) in the checkpoint, "
     r"but config.json implies \(32, 48\)$"),
], ids=["missing", "extra", "wrong-shape"])
def test_a_checkpoint_that_does_not_match_its_config_names_the_tensor(tmp_path, edit, message):
    import torch

    def edit_tensors(tensors):
        edit(tensors)
        for name, value in tensors.items():
            tensors[name] = torch.as_tensor(value)

    path = _tiny_checkpoint(tmp_path / "m", TINY_QWEN3, edit_tensors)
    with pytest.raises(ModelLoadError, match=message):
        _load(path)


def test_a_fused_checkpoint_tensor_of_the_wrong_shape_is_named(tmp_path):
    """Phi-3 stores qkv_proj fused: a config with other head counts names it and both shapes."""
    cfg = {**TINY_QWEN3, "model_type": "phi3", "head_dim": None}
    path = _tiny_checkpoint(tmp_path / "m", cfg, lambda t: None)
    cfg["num_key_value_heads"] = 4
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.self_attn\.qkv_proj\.weight' has "
                                             r"shape \(64, 32\) in the checkpoint, but config\.json "
                                             r"implies \(96, 32\)$"):
        _load(path)


def test_a_reply_stops_at_an_eos_id_only_generation_config_lists(tmp_path, default_model_dir):
    """An instruct model's end of turn is often in generation_config.json only (Gemma 2's
    <end_of_turn>, Phi-3's <|end|>): transformers' generate (and vLLM) stop there, so the engine
    does too, and a malformed file is named."""
    import torch

    from batchinfer.engine.model.loader import load_arch
    from batchinfer.engine.request import FinishReason, SamplingParams
    from tests.tiny_families import hf_greedy, hf_model, save_model

    hf = hf_model("llama3")
    path = save_model(hf, tmp_path / "m", default_model_dir)
    free = hf_greedy(hf, [[7]], 8)[0]
    stop = next(t for i, t in enumerate(free) if i > 0 and t not in free[:i] and t != 2)
    cut = free[:free.index(stop) + 1]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop]}))
    hf.generation_config.eos_token_id = [2, stop]
    with torch.inference_mode():
        assert hf.generate(torch.tensor([[7]]), max_new_tokens=8, do_sample=False,
                           pad_token_id=0)[0, 1:].tolist() == cut
    assert stop in load_arch(path).eos_token_ids
    assert stop in load_arch(path, {"num_hidden_layers": 1}).eos_token_ids

    engine = _build(path, dtype="float32")
    try:
        out = engine.generate([[7]], SamplingParams(max_tokens=8, temperature=0.0))[0]
        assert (out.output_token_ids, out.finish_reason) == (cut, FinishReason.STOP)
        out = engine.generate([[7]], SamplingParams(max_tokens=8, temperature=0.0,
                                                    ignore_eos=True))[0]
        assert out.output_token_ids == free
    finally:
        engine.close()

    (path / "generation_config.json").write_text('{"eos_token_id": "<eos>"}')
    with pytest.raises(ModelLoadError, match=r"generation_config\.json: eos_token_id must be"):
        load_arch(path)
