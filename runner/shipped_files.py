"""The recipes/ and examples/ that ship with batchinfer, and where they are on this machine.

A checkout holds them at the top of the source tree; a wheel installs them inside the package
(pyproject.toml maps them to batchinfer/recipes and batchinfer/examples). Either way they sit one
level above this module's package, so one path finds them in both. A user who installed the wheel
and types the README's `recipes/quickstart.yaml` in a directory without one is told where the
shipped copy is, rather than only "no such file".
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

SHIPPED_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_FOLDERS = ("recipes", "examples")


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
