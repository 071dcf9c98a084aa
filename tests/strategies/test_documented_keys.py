"""Every strategy's recipe keys are the ones its docs list: docs/strategies/<name>.md's "Recipe
keys" table and docs/recipe.md's table for it name each key the strategy accepts, and every key
they name is accepted (a key accepted but undocumented, or documented but refused, is what a
user trips on)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from batchinfer.strategies import STRATEGIES

DOCS = Path(__file__).resolve().parents[2] / "docs"
# pages whose table adds to the baseline's ("the baseline's keys, plus:")
ON_TOP_OF_BASELINE = {"sipipe", "sidp"}


def _table_keys(lines: list[str]) -> set[str]:
    """The backticked keys in the first column of the first table in `lines`."""
    keys: set[str] = set()
    started = False
    for line in lines:
        if line.startswith("|"):
            started = True
            first = line.split("|")[1]
            keys.update(re.findall(r"`([A-Za-z_]+)`", first))
        elif started:
            break
    return keys


def _page_keys(name: str) -> set[str]:
    lines = (DOCS / "strategies" / f"{name}.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "## Recipe keys")
    return _table_keys(lines[start + 1:])


def _recipe_md_keys(name: str) -> set[str]:
    lines = (DOCS / "recipe.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"`{name}` ("))
    return _table_keys(lines[start + 1:])


def _accepted(name: str) -> set[str]:
    return set(STRATEGIES[name].model_fields) - {"name"}


PAPER_STRATEGIES = ["baseline", "tdpipe", "gllm", "seesaw", "sipipe", "sidp"]


def _documented(keys_of, name: str) -> set[str]:
    """The keys `keys_of` documents for `name`, with the baseline's where it builds on them."""
    return keys_of(name) | (keys_of("baseline") if name in ON_TOP_OF_BASELINE else set())


@pytest.mark.parametrize("name", PAPER_STRATEGIES + ["vllm"])
def test_the_strategy_page_lists_every_key(name):
    documented = _documented(_page_keys, name)
    accepted = _accepted(name)
    assert accepted - documented == set(), "accepted but not on the page"
    if name in ON_TOP_OF_BASELINE:      # the baseline's keys it does not take are named so
        text = (DOCS / "strategies" / "baseline.md").read_text()
        for key in _page_keys("baseline") - accepted:
            assert re.search(rf"except[^.]*`{key}`", text), \
                f"baseline.md says {name} takes `{key}`; it refuses it"
    else:
        assert documented - accepted == set(), "documented but refused"


@pytest.mark.parametrize("name", PAPER_STRATEGIES)
def test_recipe_md_lists_every_key(name):
    documented = _documented(_recipe_md_keys, name)
    accepted = _accepted(name)
    assert accepted - documented == set(), "accepted but not in docs/recipe.md"
    if name not in ON_TOP_OF_BASELINE:
        assert documented - accepted == set(), "in docs/recipe.md but refused"


@pytest.mark.parametrize("keys, dp, says", [
    ({}, 2, "changes nothing at parallel.dp 2"),
    ({}, 4, "weight_slots unset"),
    ({"weight_slots": False}, 4, "weight_slots false"),
    ({"weight_slots": True}, 4, None),              # the paper's ablation: the reads reorder
    ({"weight_slots": True, "owners": [0, 0] * 15}, 2, None),   # custom owners at dp 2
])
def test_sidp_says_when_peak_shifting_off_changes_nothing(keys, dp, says):
    from batchinfer.engine.config import ParallelConfig

    params = STRATEGIES["sidp"](peak_shifting=False, **keys)
    note = params.layout_note(ParallelConfig(dp=dp))
    assert (note is None) if says is None else (says in note and "peak_shifting" in note)
    assert STRATEGIES["sidp"](**keys).layout_note(ParallelConfig(dp=dp)) is None
