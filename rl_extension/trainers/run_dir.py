"""A run's directory: preparing it, and its checkpoints (``checkpoints/step_NNNNNN``, ``checkpoints/latest``).

A checkpoint is written under a ``.tmp`` name and renamed into place when complete; the ``latest``
pointer moves after that, so a kill at any moment leaves the last complete checkpoint findable.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import spmdcall as sc
from rl_extension.config import PPOConfig, save_config, to_yaml

_T = TypeVar("_T")

__all__ = [
    "CHECKPOINT_DIR",
    "LATEST_FILE",
    "describe_stop",
    "latest_checkpoint",
    "prepare_run_dir",
    "publish_checkpoint",
    "run_with_restarts",
]

CHECKPOINT_DIR = "checkpoints"
LATEST_FILE = "latest"


def prepare_run_dir(config: PPOConfig) -> Path:
    """Create the run dir, refuse to clobber an earlier run by accident, print and save the config."""
    t = config.trainer
    run_dir = Path(t.run_dir or Path("runs") / t.experiment).resolve()
    holds_run = (run_dir / "metrics.jsonl").exists() or (run_dir / CHECKPOINT_DIR).exists()
    if holds_run and not t.resume:
        if not t.overwrite:
            raise ValueError(
                f"{run_dir} already holds a run: pass trainer.resume=true to continue it, "
                "trainer.overwrite=true to start it again, or another trainer.run_dir"
            )
        for name in ("metrics.jsonl", CHECKPOINT_DIR, "tensorboard", "plots", "hf_model"):
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / "config.yaml")
    print(f"# config (saved to {run_dir / 'config.yaml'})\n{to_yaml(config)}", flush=True)
    return run_dir


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run dir, or None."""
    pointer = Path(run_dir) / CHECKPOINT_DIR / LATEST_FILE
    if not pointer.exists():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if path.is_dir() else None


def publish_checkpoint(tmp: Path, max_checkpoints: int = 0) -> None:
    """Rename a staged checkpoint into place, point ``latest`` at it, drop the oldest beyond ``max_checkpoints`` (0 keeps all)."""
    root, final = tmp.parent, tmp.with_suffix("")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    # The pointer moves only once the checkpoint is complete: a kill at any moment leaves a valid latest.
    (root / f"{LATEST_FILE}.tmp").write_text(final.name)
    os.replace(root / f"{LATEST_FILE}.tmp", root / LATEST_FILE)
    if max_checkpoints:
        complete = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in complete[:-max_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)


def describe_stop(trainer: Any) -> str:
    """Where an interrupted GRPO/PPO run stopped and its last checkpoint (``trainer``: a PPOTrainer, or
    None when it was still being built), for the one line Ctrl-C prints."""
    if trainer is None:
        return "while the run was being built, before its first step"
    checkpoint = latest_checkpoint(trainer.run_dir)
    saved = f"last checkpoint {checkpoint}" if checkpoint else "no checkpoint yet"
    return f"at step {trainer.step} of {trainer.config.trainer.total_steps}; {saved}"


def run_with_restarts(
    train: Callable[[], _T], recover: Callable[[int], None], max_restarts: int, where: Callable[[], str]
) -> _T:
    """``train()``; after a fault (a dead rank, ``WorkerDiedError``, or a call past its deadline,
    ``CallTimeoutError``) print ``<where()> failed:`` and the error's first lines, ``recover(n)``
    for the n-th restart and ``train()`` again, at most ``max_restarts`` times; then the fault is
    raised. A worker's own exception (``WorkerError``: a bug) is never retried.

    Example:
        >>> run_with_restarts(lambda: 42, lambda n: None, max_restarts=2, where=lambda: "SFT")
        42
    """
    for restarts in itertools.count(1):
        try:
            return train()
        except (sc.WorkerDiedError, sc.CallTimeoutError) as err:
            if restarts > max_restarts:
                raise
            lines = "\n    ".join(str(err).splitlines()[:4])
            print(f"{where()} failed: {type(err).__name__}: {lines}", flush=True)
            recover(restarts)
    raise AssertionError("unreachable")
