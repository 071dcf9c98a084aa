"""`predictor train --out` over a predictor already there: interrupted before its files are
written, the old predictor stays whole; cut short while writing, no old card is left beside the
new weights (that directory is refused by name, never loaded as a predictor it is not)."""
from __future__ import annotations

import json

import pytest

from batchinfer.predictors import train as train_mod
from batchinfer.predictors.history import HistoryRecord, sha256_text
from batchinfer.predictors.train import TrainConfig, train_predictor

SHORT = "Is a {} a mammal? Answer yes or no."
LONG = "Write a long story about a {} who travels the world."
ANIMALS = ["cat", "dog", "horse", "eagle", "shark", "frog", "owl", "bee", "whale", "fox",
           "lion", "wolf", "crab", "goat", "duck", "seal", "ant", "bat", "cow", "elk",
           "emu", "yak", "pig", "hen", "ram", "eel", "gnu", "jay", "koi", "asp"]


def _records() -> list[HistoryRecord]:
    out = []
    for i, animal in enumerate(ANIMALS):
        for template, length in ((SHORT, 2 + i % 3), (LONG, 200 + 5 * i)):
            prompt = template.format(animal)
            out.append(HistoryRecord(f"r{len(out)}", prompt, sha256_text(prompt), 10, length,
                                     "stop", "m", 512))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("pred") / "p"
    train_predictor(_records(), out, TrainConfig(epochs=2, device="cpu"))
    return out


def _files(path):
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_an_interrupt_before_the_files_leaves_the_old_predictor_whole(trained, monkeypatch):
    before = _files(trained)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod, "evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_predictor(_records()[:50], trained,
                        TrainConfig(epochs=1, device="cpu", percentiles=(0, 50)))
    assert _files(trained) == before


def test_a_write_cut_short_leaves_no_old_card_beside_new_weights(trained, monkeypatch):
    assert json.loads((trained / "predictor.json").read_text())["head"]["num_classes"] > 2

    def cut(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(train_mod.bert, "save_weights", cut)
    with pytest.raises(OSError):
        train_predictor(_records()[:50], trained,
                        TrainConfig(epochs=1, device="cpu", percentiles=(0, 50)))
    assert not (trained / "predictor.json").exists()
