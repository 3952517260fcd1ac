"""A training run SIGKILLed mid-way and restarted with trainer.resume=true ends at the same step.

The run is the real CLI (`python -m rl_extension train ...`) in a subprocess, on the process
backend, with a tiny model; it is killed (controller only: its workers must notice and exit) once
a checkpoint exists, then started again with the same arguments plus trainer.resume=true.
A second test stops a run (in process) right before and right after a checkpoint is published, and
checks that every step's metrics line is there exactly once after resuming.

Run: python -m pytest tests/rl/test_resume.py -q
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from batches import SMALLEST_RUN

from rl_extension.config import PPOConfig, load_config
from rl_extension.trainers.metrics import read_jsonl
from rl_extension.trainers.ppo import PPOTrainer
from rl_extension.trainers.run_dir import latest_checkpoint

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


class Killed(BaseException):
    """Stands for a SIGKILL: a BaseException, so nothing in the trainer catches it."""


# One process (inline backend), a 1-layer model, 2 prompts x 2 samples a step: the cheapest real run.
CHEAP_RUN = [
    "trainer.backend=inline",
    "trainer.num_workers=1",
    *SMALLEST_RUN,
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=2",
    "trainer.total_steps=3",
    "trainer.save_every=1",
    "trainer.val_every=0",
    "trainer.val_before_train=false",
    "trainer.loggers=[jsonl]",
    "trainer.progress=none",
    "trainer.save_hf_model=false",
]


@pytest.mark.timeout(120)
def test_a_kill_on_either_side_of_a_checkpoint_publication_loses_no_metrics_line(tmp_path, monkeypatch):
    """The fault stops the run just before or just after the `latest` pointer moves to a step's checkpoint
    (the two sides of its publication), noting which lines were on disk at that instant: what a SIGKILL
    there would leave. Every step up to the published checkpoint must have its line then (resume keeps
    those and redoes the rest), and resuming must end with every step's line exactly once."""
    run_dir = tmp_path / "run"
    overrides = [f"trainer.run_dir={run_dir}", *CHEAP_RUN]
    real_replace = os.replace

    def run(*extra, kill=None):
        def replace(src, dst):
            publishing = kill and os.path.basename(dst) == "latest"
            if publishing and kill[0] == "before" and open(src).read() == f"step_{kill[1]:06d}":
                raise Killed(read_jsonl(run_dir / "metrics.jsonl"))
            real_replace(src, dst)
            if publishing and kill[0] == "after" and open(dst).read() == f"step_{kill[1]:06d}":
                raise Killed(read_jsonl(run_dir / "metrics.jsonl"))

        monkeypatch.setattr(os, "replace", replace)
        with PPOTrainer(load_config(PPOConfig, "tiny-cpu", [*overrides, *extra])) as trainer:
            trainer.fit()

    # Killed before its first checkpoint, the run starts afresh on resume (its old line 1 dropped, not doubled).
    for kill, published in (
        (("before", 1), None),
        (("after", 1), "step_000001"),
        (("before", 2), "step_000001"),
    ):
        with pytest.raises(Killed) as killed:
            run(*([] if kill == ("before", 1) else ["trainer.resume=true"]), kill=kill)
        on_disk = [r["step"] for r in killed.value.args[0]]
        assert getattr(latest_checkpoint(run_dir), "name", None) == published
        assert on_disk == list(range(1, kill[1] + 1)), (kill, on_disk)

    run("trainer.resume=true")
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all("actor/pg_loss" in r and "timing/save_s" in r for r in records)
