"""What the strategies' end-to-end tests share: a workload that overfills a small KV cache, and a
shipped recipe run through `batchinfer run` on the embedded default."""
from __future__ import annotations

import functools
import json
from pathlib import Path

from batchinfer.engine.request import SamplingParams

REPO = Path(__file__).resolve().parent.parent

# 16 requests that need ~3x the KV cache of TIGHT (227 tokens of SmolLM2). Real weights: with
# dummy ones each reply is mostly one token repeated, which KV read wrongly would not change
WORDS = "the quick brown fox jumps over a lazy dog while singing".split()
E2E_PROMPTS = [" ".join(WORDS[: 3 + (i * 7) % 11] * (1 + i % 3)) for i in range(16)]
E2E_PARAMS = [SamplingParams(max_tokens=12 + (i * 13) % 40, temperature=0.0, ignore_eos=True)
              for i in range(16)]
TIGHT = {"model": {"max_model_len": 128}, "cache": {"kv_cache_memory": "10MiB"}}


@functools.cache
def tight_reference() -> tuple[tuple[int, ...], ...]:
    """The single process's greedy tokens for E2E_PROMPTS under TIGHT (preempting as it goes),
    generated once per session for every strategy held to them (gLLM, TD-Pipe, Seesaw)."""
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.engine import Engine

    with Engine.from_config(EngineConfig(**TIGHT)) as engine:
        outputs = engine.generate(E2E_PROMPTS, E2E_PARAMS)
    return tuple(tuple(o.output_token_ids) for o in outputs)


def assert_context_dependent(outputs: list[list[int]]) -> None:
    """The reference replies depend on their context (else a run that read the wrong KV after a
    preemption could give the same tokens): they mostly differ, and none is one token repeated."""
    assert len({tuple(o[:8]) for o in outputs}) >= 12, outputs
    assert all(len(set(o)) > 1 for o in outputs), outputs


def run_shipped_recipe(name: str, out: Path, limit: int) -> tuple[list[dict], dict]:
    """recipes/<name>.yaml over the first `limit` quickstart prompts -> (outputs, report.json)."""
    from typer.testing import CliRunner

    from batchinfer.cli.main import app

    result = CliRunner().invoke(app, ["run", str(REPO / "recipes" / f"{name}.yaml"), "--input",
                                      str(REPO / "examples" / "quickstart.jsonl"), "--limit",
                                      str(limit), "--output", str(out), "--progress", "off"])
    assert result.exit_code == 0, result.output
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert len(outputs) == limit and all(o["text"].strip() for o in outputs)
    return outputs, json.loads((out / "report.json").read_text())
