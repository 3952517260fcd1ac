"""The ``monarch`` backend (PyTorch Monarch actors), where ``spmdcall[monarch]`` is installed.

A smoke test of the path every call takes: start, a split call with its results merged, a rank's
error naming rank and method, and shutdown leaving no process; where each rank's Monarch log goes;
and Ctrl-C in a controller running a monarch group. The whole conformance suite runs
with ``python -m spmdcall.testing monarch`` (several minutes on 2 cores: not part of this suite).
"""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import sys
import time

import psutil
import pytest

import spmdcall as sc

pytest.importorskip("monarch.actor", reason="needs spmdcall[monarch] (torchmonarch)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
def test_a_group_on_monarch_splits_merges_names_errors_logs_and_leaves_nothing(tmp_path):
    before = _ours()
    logs = tmp_path / "logs"
    with sc.WorkerGroup(
        sc.ResourcePool([2]), sc.ClassWithInitArgs(Adder, 10), backend="monarch", log_dir=logs
    ) as wg:
        assert wg.world_size == 2
        assert wg.add([[1, 2], [3]]) == [[11, 12], [13]]
        with pytest.raises(sc.WorkerError) as raised:
            wg.fail()
        message = str(raised.value)
        assert "fail" in message and "no good" in message and "rank" in message
        # Monarch 0.7 writes a process's log to /tmp/<user>/monarch_log_<MONARCH_LOG_SUFFIX>.log:
        # each rank has a file of its own, named after the group and the rank, linked into log_dir.
        linked = [i["monarch_log"] for i in wg.worker_info()]
        stopping = time.monotonic()
    # Monarch stops the processes in a second or two; the loop thread's end must not cost the whole
    # shutdown_timeout (10 s) on top, as it did when the loop stopped before handing back its result.
    assert time.monotonic() - stopping < 8.0
    assert [os.path.dirname(p) for p in linked] == [str(logs)] * 2
    assert [p.endswith(f"-rank{r}.log") for r, p in enumerate(linked)] == [True, True]
    user = pwd.getpwuid(os.getuid()).pw_name
    for path in linked:
        assert os.path.samefile(path, f"/tmp/{user}/monarch_log_{os.path.basename(path)}")
        assert "spmdcall-adder" in open(path, errors="replace").read().lower()  # its actors' events
    assert (logs / "monarch-controller.log").exists()
    left = psutil.wait_procs([psutil.Process(p) for p in _ours() - before], timeout=15)[1]
    assert not left, f"processes left after shutdown: {[p.pid for p in left]}"


CTRL_C = """
import os, signal, sys, time
# A program inherits an ignored or blocked SIGINT from the test runner; a terminal's starts with the
# default handler, as this one does (see tests/faults/test_faults.py).
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
import spmdcall as sc

class Sleeper:
    def sleep(self, ready_dir, seconds):
        open(os.path.join(ready_dir, os.environ["RANK"]), "w").close()
        time.sleep(seconds)

with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Sleeper), backend="monarch") as wg:
    wg.sleep(sys.argv[1], 60)
"""


@pytest.mark.timeout(60)
def test_ctrl_c_stops_the_controller_with_a_clear_message_and_leaves_no_process(tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", CTRL_C, str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    try:
        deadline = time.monotonic() + 45
        while len(os.listdir(ready)) < 2:  # both ranks are in the call: the controller waits on it
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        started = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert err.rstrip().splitlines()[-1] == "KeyboardInterrupt", err
    assert started and not psutil.wait_procs(started, timeout=10)[1], "processes left after Ctrl-C"
