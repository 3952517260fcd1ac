"""benchmarks/rl/compare_trl.py: the engines of one invocation, each with its own learning rate (an lr sweep)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from repo_scripts import ROOT, load_script


@pytest.fixture(scope="module")
def compare_trl():
    sys.path.insert(0, str(ROOT / "benchmarks" / "rl"))  # it imports engines.py beside it
    try:
        yield load_script(Path("benchmarks/rl/compare_trl.py"), "compare_trl")
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "rl"))


def test_each_engine_may_carry_its_own_lr(compare_trl):
    parse = compare_trl.parse_engine
    assert parse("trl", 5e-5) == ("trl", 5e-5, [])
    assert parse("trl@lr=3e-4", 5e-5) == ("trl", 3e-4, [])
    assert parse("ours@lr=1e-3@rollout.n=2", 5e-5) == ("ours", 1e-3, ["rollout.n=2"])
    for bad in ("trl@rollout.n=2", "verl", "ours@n"):
        with pytest.raises(ValueError, match="is not ours, trl"):
            parse(bad, 5e-5)
