"""The ``monarch`` backend (PyTorch Monarch actors), where ``spmdcall[monarch]`` is installed.

A smoke test of the path every call takes: start, a split call with its results merged, a rank's
error naming rank and method, and shutdown leaving no process. The whole conformance suite runs
with ``python -m spmdcall.testing monarch`` (several minutes on 2 cores: not part of this suite).
"""

from __future__ import annotations

import psutil
import pytest

import spmdcall as sc

pytest.importorskip("monarch.actor", reason="needs spmdcall[monarch] (torchmonarch)")


class Adder:
    def __init__(self, base: int):
        self.base = base

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE)
    def add(self, xs: list[int]) -> list[int]:
        return [x + self.base for x in xs]

    def fail(self) -> None:
        raise ValueError("no good")


def _ours() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.timeout(180)
def test_a_group_on_monarch_splits_merges_names_errors_and_leaves_nothing():
    before = _ours()
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Adder, 10), backend="monarch") as wg:
        assert wg.world_size == 2
        assert wg.add([[1, 2], [3]]) == [[11, 12], [13]]
        with pytest.raises(sc.WorkerError) as raised:
            wg.fail()
        message = str(raised.value)
        assert "fail" in message and "no good" in message and "rank" in message
    left = psutil.wait_procs([psutil.Process(p) for p in _ours() - before], timeout=15)[1]
    assert not left, f"processes left after shutdown: {[p.pid for p in left]}"
