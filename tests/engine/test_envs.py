"""engine/envs.py: the table of environment variables, and the warning about unknown names."""
from __future__ import annotations

import pytest

from batchinfer.engine import envs


def test_values_come_from_the_environment_or_the_table(monkeypatch):
    monkeypatch.delenv("BATCHINFER_LINEAR_KERNEL", raising=False)
    assert envs.get("BATCHINFER_LINEAR_KERNEL") == "auto"
    monkeypatch.setenv("BATCHINFER_LINEAR_KERNEL", "torch")
    assert envs.get("BATCHINFER_LINEAR_KERNEL") == "torch"
    monkeypatch.setenv("BATCHINFER_NATIVE_KERNELS", " 0 ")
    assert envs.is_off("BATCHINFER_NATIVE_KERNELS")
    monkeypatch.setenv("BATCHINFER_NATIVE_KERNELS", "1")
    assert not envs.is_off("BATCHINFER_NATIVE_KERNELS")
    with pytest.raises(KeyError):
        envs.get("BATCHINFER_NOT_A_SETTING")
    for var in envs.ENV_VARS.values():
        assert var.meaning and var.kind in ("product", "developer")


def test_unknown_names_are_found_with_the_closest_known_one():
    found = envs.unknown_in_environment({"BATCHINFER_LINEAR_KERNELS": "torch", "PATH": "/bin",
                                         "BATCHINFER_CACHE": "/tmp", "BATCHINFER_ZZZ": "1"})
    assert found == ["BATCHINFER_LINEAR_KERNELS (did you mean BATCHINFER_LINEAR_KERNEL?)",
                     "BATCHINFER_ZZZ"]


def test_run_warns_about_a_mistyped_variable(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "BATCHINFER_KV_HUGE_PAGE": "0"}
    proc = subprocess.run([sys.executable, "-m", "batchinfer.cli", "run",
                           str(tmp_path / "missing.yaml"), "--input", str(tmp_path / "in.jsonl")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "BATCHINFER_KV_HUGE_PAGE (did you mean BATCHINFER_KV_HUGE_PAGES?)" in proc.stderr


def test_the_user_manual_lists_every_variable_as_the_table_says():
    """docs/engine.md's table is the users' copy of envs.py's; a new variable must reach it."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "engine.md").read_text()
    for var in envs.ENV_VARS.values():
        default = f"`{var.default}`" if var.default is not None else "—"
        row = f"| `{var.name}` | {default} | {var.kind} | {var.meaning} |"
        assert row in doc, f"docs/engine.md lacks or differs from: {row}"
