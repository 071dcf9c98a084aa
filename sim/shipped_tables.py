"""Profile tables measured on GPUs this project was lent, shipped with the package, so that
`batchinfer profile --table h100-llama-3.1-8b` plans for that card without one here.

Each is `sim/profiler.py`'s table for the model on one GPU (the real engine's steps, CUDA graphs,
async scheduling), made by `benchmarks/engine/gpu_engine_bench.py profile`; the file name is
`<card>-<model>` and the measuring is in docs/performance.md. Only H100 tables so far: no H200
was lent.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

FOLDER = Path(__file__).resolve().parent / "gpu_tables"


def shipped_tables() -> list[str]:
    return sorted(p.name[:-len(".json")] for p in FOLDER.glob("*.json"))


def resolve_table(value: Path) -> Path:
    """--table: a file, else the name of a shipped table (ConfigError naming both when neither)."""
    if Path(value).exists():
        return Path(value)
    shipped = _shipped(str(value))
    if shipped is not None:
        return shipped
    from batchinfer.engine.errors import ConfigError

    raise ConfigError(f"--table {value}: no such file, nor a shipped table (shipped: "
                      f"{', '.join(shipped_tables())})")


def _shipped(name: str) -> Optional[Path]:
    if Path(name).parent != Path("."):
        return None
    path = FOLDER / (name if name.endswith(".json") else f"{name}.json")
    return path if path.exists() else None
