"""The recipes/ and examples/ that ship with batchinfer, and where they are on this machine.

A checkout holds them at the top of the source tree; a wheel installs them inside the package
(pyproject.toml maps them to batchinfer/recipes and batchinfer/examples). Either way they sit one
level above this module's package, so one path finds them in both. A user who installed the wheel
and types the README's `recipes/quickstart.yaml` in a directory without one is told where the
shipped copy is, rather than only "no such file".
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

SHIPPED_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_FOLDERS = ("recipes", "examples")
# the length predictors shipped with the package (a package folder: named, never copied)
SHIPPED_PREDICTORS = "predictors/shipped"


def shipped(relative: str) -> Path:
    """A shipped file or folder, e.g. shipped("examples/model-configs")."""
    return SHIPPED_ROOT / relative


def missing_file_problem(path: Union[str, Path]) -> str:
    """What to say of a file that does not exist: "no such file", and where batchinfer's own copy
    is when `path` is a relative recipes/... or examples/... path that ships."""
    path = Path(path)
    parts = path.parts
    if path.is_absolute() or len(parts) < 2 or parts[0] not in SHIPPED_FOLDERS:
        return "no such file"
    copy = SHIPPED_ROOT / path
    if not copy.is_file():
        return "no such file"
    return (f"no such file in {Path.cwd()}; batchinfer ships it as {copy}: give that path, or "
            f"copy the folder here (cp -r {SHIPPED_ROOT / parts[0]} .)")


def missing_dir_problem(path: Union[str, Path]) -> Optional[str]:
    """Where batchinfer's own copy of a directory is, when `path` is a relative examples/... or
    predictors/shipped/... path that a checkout has and this directory does not (a wheel
    install: the docs' commands name them as in the source tree); None otherwise."""
    path = Path(path)
    if path.is_absolute() or path.exists():
        return None
    text = path.as_posix()
    shipped_here = text.startswith(SHIPPED_PREDICTORS + "/") or (
        len(path.parts) >= 2 and path.parts[0] in SHIPPED_FOLDERS)
    copy = SHIPPED_ROOT / path
    if not shipped_here or not copy.exists():
        return None
    return f"{path}: not in {Path.cwd()}; batchinfer ships it as {copy}: give that path"
