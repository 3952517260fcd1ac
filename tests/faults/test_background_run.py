"""A test run started in the background of a non-interactive shell (``make test &``, a CI step)
ends with its tests' result, whatever SIGINT reaches its process group: the shell gave the job
SIGINT ignored, and the runner keeps it so (tests/conftest.py); the programs a test must Ctrl-C
get SIGINT on of their own (tests/procs.py: ``with_sigint``)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

SLOW_TEST = """
import pathlib, time

def test_outlives_a_sigint_to_its_group():
    pathlib.Path({started!r}).touch()
    time.sleep(3)
"""


def test_a_background_run_ignores_a_sigint_to_its_process_group(tmp_path):
    started = tmp_path / "started"
    (tmp_path / "test_slow.py").write_text(textwrap.dedent(SLOW_TEST.format(started=str(started))))
    # `bash -c 'cmd & wait'`: bash starts the job with SIGINT ignored, in the process group of the
    # shell (setsid below), which the SIGINT then reaches whole, as a tool that stops a job does.
    # The job is a small program that runs pytest and writes its exit status (a subshell would
    # turn SIGINT back on for what it runs).
    rc = tmp_path / "rc"
    record = "import subprocess, sys; open(sys.argv[1], 'w').write(str(subprocess.call(sys.argv[2:])))"
    job = [
        sys.executable,
        "-c",
        record,
        str(rc),
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    job += ["-p", "conftest", "--rootdir", str(tmp_path), str(tmp_path / "test_slow.py")]
    proc = subprocess.Popen(
        ["bash", "-c", shlex.join(job) + " & wait"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(TESTS)},  # -p conftest: this suite's own conftest
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert started.exists(), proc.communicate(timeout=30)[0]
        os.killpg(proc.pid, 2)  # SIGINT to the job's whole process group
        # The waiting shell itself may end at the SIGINT (bash does); the job goes on without it.
        deadline = time.monotonic() + 60
        while not (rc.exists() and rc.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        out = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert rc.read_text().strip() == "0", out
    assert "1 passed" in out and "KeyboardInterrupt" not in out
