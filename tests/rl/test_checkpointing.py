"""``Checkpointer`` and the controller's state alone, with stand-in groups (no worker process): the
file layout, staging, publishing, loading, the metrics lines a load drops, and recovery's restart.
The trainer's resume and recovery end to end are in test_resume.py and test_recover.py.

Run: python -m pytest tests/rl/test_checkpointing.py -q
"""

import json
import os
import pickle
import random

import numpy as np
import torch

from rl_extension.trainers.checkpointing import (
    STATE_FILE,
    Checkpointer,
    controller_state,
    load_controller_state,
)
from rl_extension.trainers.metrics import read_jsonl


class _Group:
    """A stateful group's stand-in: its state is ``value``, saved as one file per checkpoint folder."""

    def __init__(self, name: str, value: int, world_size: int = 2):
        self.name, self.value, self.world_size = name, value, world_size
        self.restarted: list[list[int]] = []

    def save_checkpoint(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(f"{path}/value.json", "w") as f:
            json.dump(self.value, f)

    def load_checkpoint(self, path: str) -> None:
        with open(f"{path}/value.json") as f:
            self.value = json.load(f)

    def restart(self, ranks: list[int]) -> None:
        self.restarted.append(ranks)


class _Loader:
    def __init__(self):
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


class _KL:
    value = 0.1


def _metrics(run_dir, steps):
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({"step": s}) + "\n" for s in steps)


def test_a_checkpoint_is_a_folder_per_group_and_the_controller_state(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    actor, critic = _Group("actor", 3), _Group("critic", 4)
    metrics = checkpoints.save(2, {"actor": actor, "critic": critic}, {"step": 2, "loader": {}})
    assert set(metrics) == {"timing/save_s"}
    folder = tmp_path / "checkpoints" / "step_000002"
    assert checkpoints.latest() == folder
    assert sorted(p.name for p in folder.iterdir()) == ["actor", "critic", STATE_FILE]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002"
    with open(folder / STATE_FILE, "rb") as f:
        assert pickle.load(f) == {"step": 2, "loader": {}}


def test_a_staged_checkpoint_is_not_loaded_until_published(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    actor = _Group("actor", 1)
    checkpoints.save(1, {"actor": actor}, {"step": 1})
    actor.value = 2
    staged, _ = checkpoints.stage(2, {"actor": actor}, {"step": 2})
    assert staged.name == "step_000002.tmp" and checkpoints.latest().name == "step_000001"
    checkpoints.publish(staged)
    assert checkpoints.latest().name == "step_000002"


def test_load_latest_restores_every_group_and_drops_the_metrics_lines_after_it(tmp_path):
    checkpoints = Checkpointer(tmp_path, max_checkpoints=2)
    actor = _Group("actor", 0)
    for step in (2, 4, 6):
        actor.value = step * 10
        checkpoints.save(step, {"actor": actor}, {"step": step})
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000004", "step_000006"]
    _metrics(tmp_path, [0, 1, 2, 3, 4, 5, 6, 7])
    actor.value = -1
    path, state = checkpoints.load_latest({"actor": actor})
    assert path.name == "step_000006" and state == {"step": 6} and actor.value == 60
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5, 6]


def test_load_latest_without_a_checkpoint_drops_every_metrics_line(tmp_path):
    _metrics(tmp_path, [0, 1])
    assert Checkpointer(tmp_path).load_latest({"actor": _Group("actor", 0)}) is None
    assert read_jsonl(tmp_path / "metrics.jsonl") == []


def test_restart_restarts_every_rank_of_every_group_then_loads_the_latest(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    actor, rollout = _Group("actor", 5, world_size=2), _Group("rollout", 0, world_size=3)
    checkpoints.save(1, {"actor": actor}, {"step": 1})
    actor.value = 9
    path, state = checkpoints.restart([actor, rollout], {"actor": actor})
    assert actor.restarted == [[0, 1]] and rollout.restarted == [[0, 1, 2]]
    assert state == {"step": 1} and actor.value == 5


def test_the_controller_state_puts_back_the_loader_kl_and_random_streams():
    loader, kl = _Loader(), _KL()
    loader.position = 7
    state = controller_state(3, loader.state_dict(), 0.25)
    assert set(state) == {"step", "loader", "kl_coef", "rng"}  # the keys checkpoints have always had
    assert set(state["rng"]) == {"python", "numpy", "torch"}
    drawn = (random.random(), np.random.rand(), torch.rand(1).item())
    loader.position = 0
    assert load_controller_state(state, loader, kl) == 3
    assert loader.position == 7 and kl.value == 0.25
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == drawn
