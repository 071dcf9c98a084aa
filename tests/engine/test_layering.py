"""The tree's layering (docs/architecture.md): the engine imports no job runner, strategy,
simulator or CLI; nothing outside strategies/ and resharding/ imports or names a particular
strategy; every environment variable is read through engine/envs.py."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STRATEGY_NAMES = re.compile(r"seesaw|sipipe|sidp|tdpipe|td-pipe|gllm|token throttling", re.I)


def _modules(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _imports(path: Path) -> list[str]:
    """Absolute names of what `path` imports (relative imports resolved against its package)."""
    package = ["batchinfer", *path.relative_to(ROOT).parent.parts]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.append(module)
            out += [f"{module}.{alias.name}" for alias in node.names]
    return out


def test_the_engine_imports_nothing_above_it():
    above = ("batchinfer.runner", "batchinfer.strategies", "batchinfer.sim", "batchinfer.cli",
             "batchinfer.resharding", "batchinfer.bench", "batchinfer.predictors")
    bad = [(str(p.relative_to(ROOT)), name) for p in _modules("engine") for name in _imports(p)
           if name.startswith(above)]
    assert not bad


@pytest.mark.parametrize("folder", ["engine", "runner", "sim", "cli", "bench", "predictors", "api"])
def test_no_module_outside_the_strategies_imports_a_particular_strategy(folder):
    from batchinfer.strategies import STRATEGIES

    bad = [(str(p.relative_to(ROOT)), name) for p in _modules(folder) for name in _imports(p)
           if name.startswith("batchinfer.strategies.") and name.split(".")[2] in STRATEGIES]
    assert not bad      # the registry (batchinfer.strategies) and strategies/base.py only


@pytest.mark.parametrize("folder", ["engine", "runner"])
def test_the_engine_and_the_runner_name_no_strategy(folder):
    named = [f"{p.relative_to(ROOT)}:{i}" for p in _modules(folder)
             for i, line in enumerate(p.read_text().splitlines(), 1) if STRATEGY_NAMES.search(line)]
    assert not named


def test_every_environment_variable_is_in_the_table():
    from batchinfer.engine.envs import ENV_VARS

    sources = [p for folder in ("engine", "runner", "strategies", "resharding", "sim", "cli",
                                "bench", "predictors", "api")
               for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".cpp", ".h")]
    compile_macros = {"BATCHINFER_AVX2", "BATCHINFER_AVX512", "BATCHINFER_TILE2", "BATCHINFER_VNNI",
                      "BATCHINFER_BF16DOT", "BATCHINFER_BF16_TILE", "BATCHINFER_AMX",
                      "BATCHINFER_BF16_ATTENTION"}
    read = {name for p in sources for name in re.findall(r"BATCHINFER_[A-Z0-9_]+", p.read_text())}
    assert read - compile_macros - set(ENV_VARS) == set()
    direct = [str(p.relative_to(ROOT)) for p in sources if p.name != "envs.py" and re.search(
        r"(environ(\.get)?\(?\[?|getenv\()\s*[\"']BATCHINFER_", p.read_text())]
    assert not direct        # read through engine/envs.py (C++ kernels take op arguments)
