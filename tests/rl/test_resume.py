"""A training run SIGKILLed mid-way and restarted with trainer.resume=true ends at the same step.

The run is the real CLI (`python -m rl_extension train ...`) in a subprocess, on the process
backend, with a tiny model; it is killed (controller only: its workers must notice and exit) once
a checkpoint exists, then started again with the same arguments plus trainer.resume=true.

Run: python -m pytest tests/rl/test_resume.py -q
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from rl_extension.metrics import read_jsonl
from rl_extension.trainer import latest_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOTAL_STEPS = 10


def _train_command(run_dir, *extra):
    return [
        sys.executable,
        "-m",
        "rl_extension",
        "train",
        "preset=tiny-cpu",
        f"trainer.run_dir={run_dir}",
        "model.tiny.num_layers=2",
        "model.tiny.hidden_size=64",
        "model.tiny.num_heads=2",
        "model.tiny.intermediate_size=128",
        "data.synthetic.num_train=200",
        "data.synthetic.num_val=8",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "rollout.n=4",
        f"trainer.total_steps={TOTAL_STEPS}",
        "trainer.save_every=2",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        "trainer.progress=none",
        "trainer.save_hf_model=false",
        *extra,
    ]


@pytest.mark.timeout(240)
def test_sigkill_then_resume_ends_with_the_same_number_of_steps(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT}
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(_train_command(run_dir), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 150
    workers: list[int] = []
    while time.monotonic() < deadline and first.poll() is None:
        checkpoint = latest_checkpoint(run_dir)
        steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
        if not workers:
            workers = [c.pid for c in psutil.Process(first.pid).children(recursive=True)]
        if checkpoint is not None and steps and max(steps) >= 3:
            break
        time.sleep(0.05)
    assert first.poll() is None, (
        f"the first run ended before it could be killed:\n{(tmp_path / 'first.log').read_text()}"
    )
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at = max(r["step"] for r in read_jsonl(run_dir / "metrics.jsonl"))
    assert 3 <= killed_at < TOTAL_STEPS
    saved = latest_checkpoint(run_dir)
    assert saved is not None

    # The workers notice their controller is gone and exit on their own.
    gone_by = time.monotonic() + 15
    while time.monotonic() < gone_by and any(
        psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in workers
    ):
        time.sleep(0.1)
    assert not [p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]

    second = subprocess.run(
        _train_command(run_dir, "trainer.resume=true"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"resumed from {saved}" in second.stdout
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    # Steps after the checkpoint were dropped from the log and redone: every step exactly once.
    assert steps == list(range(1, TOTAL_STEPS + 1)), steps
    assert latest_checkpoint(run_dir).name == f"step_{TOTAL_STEPS:06d}"
