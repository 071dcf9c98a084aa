"""Whether a run directory may be resumed with this input and this model.

Resume skips the ids already written. Ids name requests only within one input: a file without
ids numbers its lines (`line-1`, ...), and many datasets number their rows from 0, so resuming a
directory with another file, or with an earlier line edited, would skip requests it never ran and
report the job complete; resuming with another model would mix two models' replies in one
outputs.jsonl. The manifest therefore records the input's size and a digest of its bytes, and a
resume needs the new input to start with exactly those bytes (lines may be appended: a grown input
or a larger --limit continues the run) and the recipe's model to be the one the results came from
(its path and tokenizer compared by where they lead, which run.json records: a relative path and
its absolute form, or a resume from another directory, are the same model), with the same
sampling defaults and the same prompts and ids made of each record (`io.chat_template`,
`io.input_format`, the dataset columns read): two recipes of one file name share a default run
directory, and the second would otherwise "complete" with the first one's replies.
`--force-resume` accepts any of these changes (ids alone decide what is skipped, as before).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

import yaml

from .recipe_errors import yaml_spelling
from .run_dir import RunDirError

CHUNK = 1 << 20


class MadeOtherwise(RunDirError):
    """A run directory's results were made otherwise than this start would make them;
    `detail` says how (the input, the model's settings, the sampling ones)."""

    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.detail = detail
# the model settings that change what a request's reply is (others change how fast it comes)
MODEL_IDENTITY = ("path", "load_format", "hf_overrides", "tokenizer", "quantization", "seed")
# the io settings that change the prompt a record makes, or its id (then every record reruns)
INPUT_SETTINGS = ("chat_template", "input_format", "prompt_field", "messages_field", "id_field")


def fingerprint(path: Path, limit: Optional[int] = None) -> dict:
    """{"bytes": size, "blake2b": digest} of `path`'s first `limit` bytes (None: all of it)."""
    if limit is None:
        return fingerprint_with_prefix(path, None)[1]
    return fingerprint_with_prefix(path, limit, whole=False)[0]


def fingerprint_with_prefix(path: Path, prefix: Optional[int],
                            whole: bool = True) -> tuple[Optional[dict], dict]:
    """(fingerprint of the first `prefix` bytes, or None without a prefix; fingerprint of the
    whole file), from one read: a resume checks the recorded prefix and records the whole, and
    a large input read twice costs its start twice. `whole` false: stop at the prefix (the
    second fingerprint is then the prefix's too)."""
    digest = hashlib.blake2b(digest_size=16)
    size = 0
    at_prefix = {"bytes": 0, "blake2b": digest.hexdigest()} if prefix == 0 else None
    with open(path, "rb") as fh:
        while True:
            want = CHUNK if prefix is None or size >= prefix else min(CHUNK, prefix - size)
            if not whole and prefix is not None and size >= prefix:
                break
            chunk = fh.read(want)
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
            if prefix is not None and size == prefix:
                at_prefix = {"bytes": size, "blake2b": digest.copy().hexdigest()}
    read = {"bytes": size, "blake2b": digest.hexdigest()}
    if prefix is not None and at_prefix is None:      # shorter than the prefix
        at_prefix = read
    return at_prefix, read


def check_input(run_dir: Path, recorded: Optional[dict], input_path: Path,
                recorded_path: Optional[str], now: Optional[dict] = None) -> None:
    """RunDirError unless `input_path` begins with the bytes the run recorded (nothing recorded,
    a directory written before the record existed: nothing to check). `now`: the input's
    fingerprint over the recorded length, where the caller has it already."""
    if not recorded or "bytes" not in recorded:
        return
    if now is None:
        now = fingerprint(input_path, recorded["bytes"])
    if now == recorded:
        return
    was = recorded_path or "another file"
    shorter = now["bytes"] < recorded["bytes"]
    if shorter:
        change = (f"it is shorter ({now['bytes']:,} bytes) than the input the run's last start "
                  "read")
    else:
        change = "its first lines differ from the input the run's last start read"
    raise MadeOtherwise(
        f"{run_dir} holds results for {was} ({recorded['bytes']:,} bytes); --input {input_path}: "
        f"{change}, so the ids already written may name other requests there (a file without "
        "ids numbers its lines) and resuming would skip requests that never ran. Resume with the "
        "same input (lines may be appended), write to another --output, or pass --force-resume "
        "to skip by ids anyway",
        f"another input: {was} ({recorded['bytes']:,} bytes), where --input {input_path} "
        + ("is shorter" if shorter else "differs in its first lines"))


# the model settings that name files: compared by where they lead, not how they are spelt
LOCATIONS = ("path", "tokenizer")


def model_locations(model: Any) -> dict:
    """{"path": ..., "tokenizer": ...} of the recipe's ModelConfig as absolute paths where they
    name something on this machine (as given otherwise: a hub id, empty), for run.json: a resume
    from another directory, or with the path spelt otherwise, is the same model."""
    return {key: _where(getattr(model, key, None)) for key in LOCATIONS}


def _where(value: Optional[str]) -> Optional[str]:
    """A path that exists here, made absolute; anything else as it is."""
    if value and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    return value


def check_model(run_dir: Path, old_recipe_yaml: Optional[str], model: Any,
                recorded_locations: Optional[dict] = None) -> None:
    """RunDirError when the results were written by another model than `model` (the recipe's
    ModelConfig) says: its path, weights or overrides differ. `recorded_locations`: run.json's
    model_locations of the start, so that the path and tokenizer compare by where they lead
    (a relative path and its absolute form are one model)."""
    if not old_recipe_yaml:
        return
    try:
        old = (yaml.safe_load(old_recipe_yaml) or {}).get("model") or {}
    except yaml.YAMLError:
        return
    new = model.model_dump(mode="json")
    defaults = type(model)().model_dump(mode="json")
    now = model_locations(model)

    located = {key for key in LOCATIONS if recorded_locations and key in recorded_locations}

    def before(key: str):
        return recorded_locations[key] if key in located else old.get(key, defaults.get(key))

    def after(key: str):
        return now[key] if key in located else new.get(key)

    def same(key: str) -> bool:
        if before(key) == after(key):
            return True
        if key in LOCATIONS and old.get(key) == new.get(key) and new.get(key) \
                and Path(new[key]).expanduser().is_absolute():
            return True       # one absolute path (a link to node-local storage leads elsewhere)
        # a run.json from before model_locations: the old spelling, read from here
        return key in LOCATIONS and key not in located and _where(before(key)) == now[key]

    changed = [key for key in MODEL_IDENTITY if not same(key)]
    if not changed:
        return
    detail = "; ".join(f"model.{key}: {before(key)!r} -> {after(key)!r}" for key in changed)
    raise MadeOtherwise(
        f"{run_dir} holds results of another model ({detail}); resuming would mix two models' "
        "replies in one outputs.jsonl. Write to another --output, or pass --force-resume to "
        "resume anyway", f"another model ({detail})")


def check_resume(run_dir: Path, manifest: dict, old_recipe_yaml: Optional[str], recipe,
                 input_path: Path, input_prefix: Optional[dict] = None) -> None:
    """Both checks for a run directory that already holds results (the job and --dry-run), on
    its run.json and recipe.resolved.yaml as read; `input_prefix`: as check_input's `now`."""
    if not manifest:
        raise MadeOtherwise(
            f"{run_dir} holds results but no run.json: they were not written by batchinfer "
            "(or its run.json was removed), and nothing tells which input and model made them; "
            "pick another --output, or pass --force-resume to take them as this run's (their "
            "ids are then skipped)", "results without a run.json")
    check_model(run_dir, old_recipe_yaml, recipe.model, manifest.get("model_locations"))
    check_reply_settings(run_dir, old_recipe_yaml, recipe)
    check_input(run_dir, manifest.get("input_fingerprint"), Path(input_path).resolve(),
                manifest.get("input"), input_prefix)


def check_reply_settings(run_dir: Path, old_recipe_yaml: Optional[str], recipe) -> None:
    """RunDirError when the results were written with other sampling defaults, or prompts or
    ids made otherwise (INPUT_SETTINGS), than `recipe` says: a resume would mix replies of two
    settings in one outputs.jsonl (or, ids changed, run every record again beside them)."""
    if not old_recipe_yaml:
        return
    try:
        old = yaml.safe_load(old_recipe_yaml) or {}
    except yaml.YAMLError:
        return
    new = recipe.model_dump(mode="json")             # what recipe.to_yaml() writes
    defaults = type(recipe)().model_dump(mode="json")
    keys = [("sampling", key) for key in sorted({*(old.get("sampling") or {}),
                                                 *(new.get("sampling") or {})})]
    keys += [("io", key) for key in INPUT_SETTINGS]

    def value(recipe_dict: dict, section: str, key: str):
        return (recipe_dict.get(section) or {}).get(key, (defaults.get(section) or {}).get(key))

    def spelled(recipe_dict: dict, section: str, key: str) -> str:
        return yaml_spelling(value(recipe_dict, section, key))

    changed = [f"{section}.{key}: {spelled(old, section, key)} -> {spelled(new, section, key)}"
               for section, key in keys if value(old, section, key) != value(new, section, key)]
    if changed:
        raise MadeOtherwise(
            f"{run_dir} holds results made with other settings ({'; '.join(changed)}); resuming "
            "would mix replies of both in one run: give another --output (recipes of the same "
            "file name share the default one), or --force-resume to go on anyway",
            f"other settings ({'; '.join(changed)})")


def check_other_parts(part_dir: Path, recipe, input_path: Path,
                      whole: Optional[dict] = None) -> None:
    """RunDirError when another part of this Slurm run (a sibling part-*-of-* directory that
    holds results) was made from another input, model or reply settings than this part is
    about to use: `batchinfer report` merges the parts into one run. A part with no results
    yet (a start that stopped before any request ran) constrains nothing, as it would not on
    its own resume. `whole`: this input's fingerprint (read here, once, if a part needs it); a
    part recorded over another length is compared over its length (an input grown between or
    during the parts' starts), each length read once."""
    from .run_dir import ERRORS, MANIFEST, OUTPUTS, RECIPE, list_parts, read_json

    prefixes: dict[int, dict] = {}
    for other in list_parts(part_dir.parent):
        if other.name == part_dir.name or not (other / MANIFEST).is_file():
            continue
        if not any((other / name).is_file() and (other / name).stat().st_size
                   for name in (OUTPUTS, ERRORS)):
            continue
        manifest = read_json(other / MANIFEST)
        try:
            old_recipe = (other / RECIPE).read_text() if (other / RECIPE).is_file() else None
        except OSError:
            old_recipe = None
        if not isinstance(manifest, dict):
            continue          # a part whose files cannot be read is its own resume's concern
        if whole is None:
            whole = fingerprint(input_path)
        recorded = manifest.get("input_fingerprint") or {}
        now = whole
        # over the bytes the part recorded: fewer (the input grew since), or more (it grew
        # while the parts started, after this one read it: read again now)
        if "bytes" in recorded and recorded["bytes"] != whole["bytes"]:
            if recorded["bytes"] not in prefixes:
                prefixes[recorded["bytes"]] = fingerprint(input_path, recorded["bytes"])
            now = prefixes[recorded["bytes"]]
        try:
            check_resume(other, manifest, old_recipe, recipe, input_path, now)
        except MadeOtherwise as exc:
            raise RunDirError(
                f"{other} (another part of this Slurm run) holds results made from {exc.detail}; "
                "`batchinfer report` would merge both into one run. Give every task the same "
                "input and recipe, write to another --output, or pass --force-resume to run "
                "anyway") from None


def recorded_input_bytes(manifest: dict) -> Optional[int]:
    """The input length run.json recorded (None: nothing recorded)."""
    recorded = manifest.get("input_fingerprint") or {}
    return recorded.get("bytes")


def numerics_changed(old_engine: Optional[dict], engine_info: dict) -> Optional[str]:
    """A resumed run whose earlier results came from other arithmetic than this session's (e.g.
    `dtype: auto` resolved on a host with native bf16 before, on one without now): the warning
    to log, or None. The replies stay valid; they are just not from one dtype."""
    if not old_engine:
        return None
    changes = [f"{key} {old_engine[key]} -> {engine_info[key]}"    # a key either engine does
               for key in ("device", "dtype", "kv_cache_dtype", "quantization")   # not record:
               if key in old_engine and key in engine_info                     # not compared
               and old_engine[key] != engine_info[key]]
    if not changes:
        return None
    return ("this session computes in other numerics than the run's earlier results ("
            + ", ".join(changes) + "); set model.dtype (and device.device) in the recipe to keep "
            "one for the whole run")


def recipe_change_warning(run_path: Path, old_yaml: Optional[str], new_yaml: str,
                          has_results: bool) -> Optional[str]:
    """The warning a resume with another recipe gets (`run`, and `run --dry-run` beforehand);
    None where nothing was written yet or the recipe is the same."""
    if not has_results or old_yaml is None or old_yaml == new_yaml:
        return None
    return (f"{run_path}: the recipe differs from the one this run's results were first made "
            f"with ({recipe_changes(old_yaml, new_yaml)}); results already written keep their "
            "settings")


def recipe_changes(old_yaml: str, new_yaml: str, most: int = 6) -> str:
    """What a resumed run's recipe changed, key by key ('parallel.pp: 1 -> 2'), for
    the warning that results already written keep the old settings."""
    def flat(node, prefix=""):
        if isinstance(node, dict):
            out = {}
            for key, value in node.items():
                out.update(flat(value, f"{prefix}{key}."))
            return out
        return {prefix.rstrip("."): node}

    try:
        old, new = flat(yaml.safe_load(old_yaml) or {}), flat(yaml.safe_load(new_yaml) or {})
    except yaml.YAMLError:
        return "unreadable before"
    # the strategy (and any section's name) first, then the layout, then the rest by name
    order = sorted(old.keys() | new.keys(),
                   key=lambda key: (not key.endswith(".name"), not key.startswith("parallel."), key))
    # a section whose name changed (another strategy) has other keys: its name says it
    renamed = {key[:-len("name")] for key in order
               if key.endswith(".name") and old.get(key) != new.get(key)}
    changed = [f"{key}: {yaml_spelling(old.get(key))} -> {yaml_spelling(new.get(key))}"
               for key in order if old.get(key) != new.get(key)
               and (key.endswith(".name") or not key.startswith(tuple(renamed)))]
    if not changed:
        return "its layout only"
    more = f"; {len(changed) - most} more" if len(changed) > most else ""
    return "; ".join(changed[:most]) + more
