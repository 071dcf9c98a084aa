"""Whether a run directory may be resumed with this input and this model.

Resume skips the ids already written. Ids name requests only within one input: a file without
ids numbers its lines (`line-1`, ...), and many datasets number their rows from 0, so resuming a
directory with another file, or with an earlier line edited, would skip requests it never ran and
report the job complete; resuming with another model would mix two models' replies in one
outputs.jsonl. The manifest therefore records the input's size and a digest of its bytes, and a
resume needs the new input to start with exactly those bytes (lines may be appended: a grown input
or a larger --limit continues the run) and the recipe's model to be the one the results came from.
`--force-resume` accepts either change (ids alone decide what is skipped, as before).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

import yaml

from .run_dir import RunDirError

CHUNK = 1 << 20
# the model settings that change what a request's reply is (others change how fast it comes)
MODEL_IDENTITY = ("path", "load_format", "hf_overrides", "tokenizer", "quantization", "seed")


def fingerprint(path: Path, limit: Optional[int] = None) -> dict:
    """{"bytes": size, "blake2b": digest} of `path`'s first `limit` bytes (None: all of it)."""
    digest = hashlib.blake2b(digest_size=16)
    size = 0
    with open(path, "rb") as fh:
        while limit is None or size < limit:
            chunk = fh.read(CHUNK if limit is None else min(CHUNK, limit - size))
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "blake2b": digest.hexdigest()}


def check_input(run_dir: Path, recorded: Optional[dict], input_path: Path,
                recorded_path: Optional[str]) -> None:
    """RunDirError unless `input_path` begins with the bytes the run recorded (nothing recorded,
    a directory written before the record existed: nothing to check)."""
    if not recorded or "bytes" not in recorded:
        return
    now = fingerprint(input_path, recorded["bytes"])
    if now == recorded:
        return
    was = recorded_path or "another file"
    if now["bytes"] < recorded["bytes"]:
        change = f"it is shorter ({now['bytes']:,} bytes) than the input this run started with"
    else:
        change = "its first lines differ from the input this run started with"
    raise RunDirError(
        f"{run_dir} holds results for {was} ({recorded['bytes']:,} bytes); --input {input_path}: "
        f"{change}, so the ids already written may name other requests there (a file without "
        "ids numbers its lines) and resuming would skip requests that never ran. Resume with the "
        "same input (lines may be appended), write to another --output, or pass --force-resume "
        "to skip by ids anyway")


def check_model(run_dir: Path, old_recipe_yaml: Optional[str], model: Any) -> None:
    """RunDirError when the results were written by another model than `model` (the recipe's
    ModelConfig) says: its path, weights or overrides differ."""
    if not old_recipe_yaml:
        return
    try:
        old = (yaml.safe_load(old_recipe_yaml) or {}).get("model") or {}
    except yaml.YAMLError:
        return
    new = model.model_dump(mode="json")
    defaults = type(model)().model_dump(mode="json")
    changed = [key for key in MODEL_IDENTITY
               if old.get(key, defaults.get(key)) != new.get(key)]
    if not changed:
        return
    detail = "; ".join(f"model.{key}: {old.get(key, defaults.get(key))!r} -> {new.get(key)!r}"
                       for key in changed)
    raise RunDirError(
        f"{run_dir} holds results of another model ({detail}); resuming would mix two models' "
        "replies in one outputs.jsonl. Write to another --output, or pass --force-resume to "
        "resume anyway")


def check_resume(run_dir: Path, manifest: dict, old_recipe_yaml: Optional[str], recipe,
                 input_path: Path) -> None:
    """Both checks for a run directory that already holds results (the job and --dry-run), on
    its run.json and recipe.resolved.yaml as read."""
    check_model(run_dir, old_recipe_yaml, recipe.model)
    check_input(run_dir, manifest.get("input_fingerprint"), Path(input_path).resolve(),
                manifest.get("input"))
