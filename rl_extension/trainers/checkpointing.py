"""``Checkpointer``: a run's checkpoints and the recovery that reloads them, a part the trainer holds.

A checkpoint is one folder, ``<run_dir>/checkpoints/step_NNNNNN``: a subfolder per stateful group
(``actor``, ``critic``, ...), written by the group's own ``save_checkpoint``, and ``trainer_state.pkl``,
the controller's state (``controller_state``: step, data position, KL coefficient, RNG states). It
is written under a ``.tmp`` name and published when complete (``run_dir.publish_checkpoint``), so a
kill at any moment leaves the last complete one for resume.

The trainer hands the groups and its state to each call; nothing here holds a group or reads the
trainer, so the checkpointer is tested alone (tests/rl/test_checkpointing.py):

    checkpoints = Checkpointer(run_dir, max_checkpoints=2)
    checkpoints.save(step, {"actor": actor_group}, controller_state(step, loader.state_dict(), 0.0))
    path, state = checkpoints.load_latest({"actor": actor_group})  # None before the first checkpoint
"""

from __future__ import annotations

import pickle
import random
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from rl_extension.trainers.metrics import truncate_jsonl
from rl_extension.trainers.run_dir import CHECKPOINT_DIR, latest_checkpoint, publish_checkpoint

__all__ = ["STATE_FILE", "Checkpointer", "controller_state", "load_controller_state"]

STATE_FILE = "trainer_state.pkl"
"""The controller's state in a checkpoint folder, beside one folder per stateful group."""


class StatefulGroup(Protocol):
    """What a checkpoint needs of a group (a role's ``WorkerGroup``): every rank saves and loads its part."""

    def save_checkpoint(self, path: str) -> Any: ...

    def load_checkpoint(self, path: str) -> Any: ...


class RestartableGroup(Protocol):
    """What recovery needs of a group: its size and a restart of ranks."""

    world_size: int

    def restart(self, ranks: list[int]) -> Any: ...


class Checkpointer:
    """Writes a run's checkpoints and loads the latest, for resume and for recovery after a fault.

    Not shared between threads: the trainer's thread alone calls it.

    Args:
        run_dir: the run's directory; checkpoints go to ``run_dir/checkpoints``, and loading one drops
            the lines of ``run_dir/metrics.jsonl`` after its step (those steps are trained again).
        max_checkpoints: how many complete checkpoints to keep (0 keeps all).

    Example:
        >>> checkpoints = Checkpointer(run_dir)  # doctest: +SKIP
        >>> checkpoints.save(4, roles.stateful(), state)
        {'timing/save_s': 0.8}
    """

    def __init__(self, run_dir: Path, max_checkpoints: int = 0):
        self.run_dir = Path(run_dir)
        self.max_checkpoints = max_checkpoints

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        return latest_checkpoint(self.run_dir)

    def stage(
        self, step: int, groups: Mapping[str, StatefulGroup], state: dict
    ) -> tuple[Path, dict[str, float]]:
        """Write step ``step``'s checkpoint under a ``.tmp`` name, which no load reads until ``publish``:
        ``groups[name]`` saves to the subfolder ``name``, ``state`` (the controller's) to STATE_FILE.
        Returns the staged folder and ``timing/save_s``."""
        start = time.perf_counter()
        tmp = self.run_dir / CHECKPOINT_DIR / f"step_{step:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for name, group in groups.items():
            group.save_checkpoint(str(tmp / name))
        with open(tmp / STATE_FILE, "wb") as f:
            pickle.dump(state, f)
        return tmp, {"timing/save_s": time.perf_counter() - start}

    def publish(self, staged: Path) -> None:
        """Rename a staged checkpoint into place and point ``latest`` at it (dropping the oldest beyond
        ``max_checkpoints``)."""
        publish_checkpoint(staged, self.max_checkpoints)

    def save(self, step: int, groups: Mapping[str, StatefulGroup], state: dict) -> dict[str, float]:
        """``stage`` then ``publish``; returns ``timing/save_s``."""
        staged, metrics = self.stage(step, groups, state)
        self.publish(staged)
        return metrics

    def load_latest(self, groups: Mapping[str, StatefulGroup]) -> tuple[Path, dict] | None:
        """Load every group's state from the latest checkpoint and return its folder and the controller's
        state, the metrics lines after its step dropped. None when there is no checkpoint yet (the run
        starts again from step 0: every metrics line is dropped)."""
        latest = self.latest()
        if latest is None:
            truncate_jsonl(self.run_dir / "metrics.jsonl", -1)
            return None
        for name, group in groups.items():
            group.load_checkpoint(str(latest / name))
        with open(latest / STATE_FILE, "rb") as f:
            state = pickle.load(f)
        truncate_jsonl(self.run_dir / "metrics.jsonl", state["step"])  # steps after it are trained again
        return latest, state

    def restart(
        self, groups: Iterable[RestartableGroup], stateful: Mapping[str, StatefulGroup]
    ) -> tuple[Path, dict] | None:
        """Recovery after a dead or hung rank: restart every rank of every group, which runs each role's
        constructor again (a fresh process per rank, torch.distributed formed again, as at start; a hung
        call is abandoned), then ``load_latest(stateful)``."""
        for group in groups:
            group.restart(list(range(group.world_size)))
        return self.load_latest(stateful)


def controller_state(step: int, loader_state: dict, kl_coef: float) -> dict:
    """The controller's part of a checkpoint: the step, the prompt loader's position, the KL
    coefficient and this process's RNG states (python, numpy, torch)."""
    return {
        "step": step,
        "loader": loader_state,
        "kl_coef": kl_coef,
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
    }


def load_controller_state(state: dict, loader: Any, kl_ctrl: Any) -> int:
    """Put a ``controller_state`` back: ``loader``'s position (``load_state_dict``), ``kl_ctrl.value``
    and the RNG states. Returns the step."""
    loader.load_state_dict(state["loader"])
    kl_ctrl.value = state["kl_coef"]
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    return state["step"]
