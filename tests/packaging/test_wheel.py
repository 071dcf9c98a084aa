"""The wheel users `pip install` holds every file the package reads at run time.

A checkout runs from its source tree, so a file left out of pyproject's package-data only shows
once installed from a wheel: the kernels would not build, `profile --model` would not find the
model configs it plans with, the README's recipes and examples would be nowhere. The wheel is
built from a copy of the tree (the shared checkout gets no build/ folder) and listed, not
installed.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
ROOT = Path(__file__).resolve().parents[2]


def _package_dirs() -> dict[str, str]:
    """Source folder -> the package path it installs as (api -> batchinfer, engine ->
    batchinfer/engine, ...), from pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {folder: package.replace(".", "/") for package, folder in config["package-dir"].items()}


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    pytest.importorskip("setuptools")
    tree = tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    for folder in _package_dirs():
        shutil.copytree(ROOT / folder, tree / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(out), str(tree)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("batchinfer-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def _in_wheel(path: Path) -> str:
    """Where the tree's file `path` lands in the wheel."""
    relative = path.resolve().relative_to(ROOT)
    package = _package_dirs().get(relative.parts[0])
    if package is None:
        return f"{relative} (its folder is no package in pyproject.toml)"
    return "/".join([package, *relative.parts[1:]])


def _runtime_files() -> list[Path]:
    from batchinfer.engine import kernels
    from batchinfer.predictors.auto import SHIPPED_DIR
    from batchinfer.runner.shipped_files import shipped
    from batchinfer.sim.planner import SHIPPED_CONFIGS
    from batchinfer.sim.shipped_tables import FOLDER as GPU_TABLES

    files = [source for sources, _ in kernels._BUILDS.values() for source in sources]
    files += [*kernels._DIR.glob("*.h"), kernels._DIR / "compile.py"]
    files += [p for p in SHIPPED_DIR.glob("*/*") if p.is_file()]
    files += [*GPU_TABLES.glob("*.json"), *SHIPPED_CONFIGS.glob("*/config.json")]
    files += [*shipped("recipes").glob("*.yaml"), *shipped("examples").glob("quickstart*.jsonl")]
    return files


def test_every_file_read_at_run_time_is_in_the_wheel(wheel_names):
    files = _runtime_files()
    assert any(p.suffix == ".cpp" for p in files) and any(p.name == "config.json" for p in files)
    missing = [_in_wheel(p) for p in files if _in_wheel(p) not in wheel_names]
    assert not missing


def test_the_readme_quickstart_files_ship_where_the_package_finds_them(wheel_names):
    assert "batchinfer/recipes/quickstart.yaml" in wheel_names
    assert "batchinfer/examples/quickstart.jsonl" in wheel_names
    assert "batchinfer/examples/model-configs/qwen3-30b-a3b/config.json" in wheel_names


def test_every_module_of_the_tree_is_in_the_wheel(wheel_names):
    modules = [p for folder in _package_dirs() for p in (ROOT / folder).rglob("*.py")
               if "__pycache__" not in p.parts]
    missing = [_in_wheel(p) for p in modules if _in_wheel(p) not in wheel_names]
    assert not missing          # a new subpackage needs its line in pyproject's packages
