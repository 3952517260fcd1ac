"""A run with trainer.max_restarts recovers by itself from a dead or hung rank, in the same process.

A background thread watches metrics.jsonl and, once a (seeded) random step is logged, SIGKILLs (or
SIGSTOPs: a hang past trainer.call_timeout_s) the real process of a random rank of the actor's group,
taken from ``group.worker_info()``. The trainer must restart its groups, reload the latest checkpoint
and finish with every step's metrics line exactly once, each equal to the same run without faults.
With max_restarts=0 the error reaches the caller as before.

Run: python -m pytest tests/rl/test_recover.py -q
"""

import os
import random
import signal
import threading
import time

import pytest
from batches import SMALLEST_RUN

import spmdcall as sc
from rl_extension.config import PPOConfig, load_config
from rl_extension.trainers.metrics import read_jsonl
from rl_extension.trainers.ppo import PPOTrainer

TOTAL_STEPS = 4

# Two processes, a 1-layer model, 2 prompts x 2 samples a step, a checkpoint every 2 steps.
RUN = [
    "trainer.num_workers=2",
    *SMALLEST_RUN,
    "data.train_batch_size=2",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=2",
    f"trainer.total_steps={TOTAL_STEPS}",
    "trainer.save_every=2",
    "trainer.val_every=0",
    "trainer.val_before_train=false",
    "trainer.loggers=[jsonl]",
    "trainer.progress=none",
    "trainer.save_hf_model=false",
    # Nothing is learned from a reward of 0 (a random model's): a demonstration in each failed group
    # gives every step a gradient, so the weights move and a lost or doubled update would show.
    "algorithm.guide_failed_groups=true",
]


def _numbers(record: dict) -> dict:
    """A metrics line less what depends on the machine's speed (timings, throughput)."""
    return {k: v for k, v in record.items() if k != "time" and not k.startswith(("timing/", "perf/"))}


def _run(run_dir, *extra, fault=None):
    """Train in this process; ``fault``: (signal, rank, after_step), sent to the actor group's rank
    once ``after_step`` is in metrics.jsonl. Returns the metrics lines and the pids hit."""
    config = load_config(PPOConfig, "tiny-cpu", [f"trainer.run_dir={run_dir}", *RUN, *extra])
    with PPOTrainer(config) as trainer:
        hit = _fit(trainer, lambda: trainer.roles.actor, run_dir / "metrics.jsonl", fault)
    return read_jsonl(run_dir / "metrics.jsonl"), hit


def _fit(trainer, group, metrics_file, fault):
    """``trainer.fit()``, with ``fault`` (as for :func:`_run`) sent to a rank of ``group()`` from a
    thread that watches ``metrics_file``. The pids hit."""
    hit: list[int] = []
    done = threading.Event()
    if fault is not None:
        threading.Thread(target=_inject, args=(group, metrics_file, fault, done, hit), daemon=True).start()
    try:
        trainer.fit()
    finally:
        done.set()
    return hit


def _inject(group, metrics_file, fault, done, hit):
    sig, rank, after_step = fault
    while not done.is_set():
        if any(r.get("step", 0) >= after_step for r in read_jsonl(metrics_file)):
            pid = group().worker_info()[rank]["pid"]
            os.kill(pid, sig)
            hit.append(pid)
            return
        time.sleep(0.02)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """The same run without faults (process backend): what every recovered run must equal."""
    records, _ = _run(tmp_path_factory.mktemp("clean") / "run")
    assert [r["step"] for r in records] == list(range(1, TOTAL_STEPS + 1))
    return records


def _assert_same_run(records, clean_run):
    assert [r["step"] for r in records] == list(range(1, TOTAL_STEPS + 1))  # each step exactly once
    for got, want in zip(records, clean_run):
        assert _numbers(got) == pytest.approx(_numbers(want), rel=1e-6, abs=1e-9), got["step"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [0])
def test_a_sigkilled_rank_is_restarted_and_the_run_ends_as_without_faults(tmp_path, clean_run, seed, capfd):
    """A drawn rank is killed once step 2 or 3 is logged: in step 3 (redone from the checkpoint of
    step 2) or in step 4 (step 3, already logged, is dropped and redone). Seed 0 draws rank 1, step 3."""
    rng = random.Random(seed)
    fault = (signal.SIGKILL, rng.randrange(2), rng.randint(2, 3))
    records, hit = _run(tmp_path / "run", "trainer.max_restarts=2", fault=fault)
    assert hit, "the fault was never injected"
    out = capfd.readouterr().out
    assert "WorkerDiedError" in out and "restart 1 of 2" in out, out[-3000:]
    _assert_same_run(records, clean_run)


@pytest.mark.timeout(120)
def test_a_rank_stopped_past_the_call_timeout_is_restarted(tmp_path, clean_run, capfd):
    """SIGSTOP in step 2: the rank neither dies nor answers, and the call's deadline ends the wait.
    No checkpoint exists yet, so the run starts again from step 0 in the same process."""
    records, hit = _run(
        tmp_path / "run",
        "trainer.max_restarts=1",
        "trainer.call_timeout_s=5",
        fault=(signal.SIGSTOP, 1, 1),
    )
    assert hit
    out = capfd.readouterr().out
    assert "CallTimeoutError" in out and "restart 1 of 1" in out and "step 0 (no checkpoint yet)" in out, out[
        -3000:
    ]
    _assert_same_run(records, clean_run)


@pytest.mark.timeout(120)
def test_without_restarts_a_dead_rank_raises_as_before(tmp_path):
    with pytest.raises(sc.WorkerDiedError):
        _run(tmp_path / "run", "trainer.total_steps=2", fault=(signal.SIGKILL, 0, 1))


@pytest.mark.timeout(180)
def test_a_sigkilled_rank_on_ray_is_restarted(tmp_path, clean_run, ray_session, capfd):
    """The ray run is compared with the process run: the same computation, gloo on both."""
    records, hit = _run(
        tmp_path / "run", "trainer.backend=ray", "trainer.max_restarts=1", fault=(signal.SIGKILL, 1, 3)
    )
    assert hit
    out = capfd.readouterr().out
    assert "WorkerDiedError" in out and "restart 1 of 1" in out, out[-3000:]
    _assert_same_run(records, clean_run)


SFT_RUN = [
    "num_workers=2",
    *SMALLEST_RUN,
    "batch_size=4",
    "total_steps=6",
    "eval_every=0",
    "stop_at_accuracy=0",
    "log_every=0",
]


def _sft(out, *extra, kill_after=None):
    """SFT in this process; ``kill_after``: SIGKILL rank 1 once that step is in metrics.jsonl."""
    from rl_extension.config import SFTConfig
    from rl_extension.trainers.sft import SFTTrainer

    config = load_config(SFTConfig, "sft-tiny-cpu", [f"output_dir={out}", *SFT_RUN, *extra])
    fault = None if kill_after is None else (signal.SIGKILL, 1, kill_after)
    with SFTTrainer(config) as sft:
        hit = _fit(sft, lambda: sft.group, out / "metrics.jsonl", fault)
    return read_jsonl(out / "metrics.jsonl"), hit


@pytest.mark.timeout(240)
def test_sft_with_a_sigkilled_rank_trains_again_from_step_0_and_ends_as_without_faults(tmp_path):
    clean, _ = _sft(tmp_path / "clean")
    recovered, hit = _sft(tmp_path / "faulty", "max_restarts=1", kill_after=3)
    assert hit, "the rank was never killed"
    assert [r["step"] for r in recovered] == list(range(1, 7))  # every step once
    for again, first in zip(recovered, clean, strict=True):
        assert _numbers(again) == pytest.approx(_numbers(first), rel=1e-6)
