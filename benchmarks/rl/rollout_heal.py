"""An async GRPO run that loses a rollout rank mid-run, beside the same run undisturbed (#68).

Two runs of the tiny preset, ``trainer.mode=async`` with 2 rollout workers and 2 actor workers,
``--steps`` steps each, one after the other (a disturbed run, then its undisturbed control; with
``--rounds`` > 1 they alternate), after a warm-up run not counted. In the disturbed run, after step ``--kill-at`` is logged, rollout
rank 1 is found by its process title (``spmdcall HFRollout 1/2``, as ``ps`` shows it) and
SIGKILLed; the trainer replaces it and goes on. Printed, and written to ``--out`` as JSON: each
run's wall time, the steps it logged, the actor's processes before and after, and the seconds
the replacement took (its span in ``timeline.jsonl``); the time lost is the disturbed run's wall
time less the control's, which the replacement's own start bounds from below.

    python benchmarks/rl/rollout_heal.py --steps 30 --kill-at 10 --out runs/rollout-heal.json

``--scale GROW,SHRINK`` runs instead one run that starts with 1 rollout worker, asks for 2 after
step GROW (``trainer.scale_rollout``, as ``spmdcall-rl scale`` does) and for 1 after step SHRINK,
and prints the rollout's samples per second of generating (``rows / async/generate_s``) and the
steps per second in each of the three phases:

    python benchmarks/rl/rollout_heal.py --steps 30 --scale 10,20
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from rl_extension.config import PPOConfig, load_config
from rl_extension.trainers.async_ppo import AsyncPPOTrainer
from rl_extension.trainers.metrics import read_jsonl

RUN = [
    "trainer.mode=async",
    "trainer.max_staleness=1",
    "trainer.num_workers=2",
    "trainer.rollout_workers=2",
    "trainer.val_every=0",
    "trainer.val_before_train=false",
    "trainer.loggers=[jsonl]",
    "trainer.progress=none",
    "trainer.save_hf_model=false",
    "trainer.save_every=0",
]


def processes(groups: list, title: str) -> dict[str, int]:
    """This run's ranks whose process title starts with ``title``: title -> pid."""
    import psutil

    found = {}
    for info in (i for g in groups for i in g.worker_info()):
        name = " ".join(psutil.Process(info["pid"]).cmdline())
        if name.startswith(title):
            found[name] = info["pid"]
    return found


class KillingTrainer(AsyncPPOTrainer):
    """SIGKILLs rollout rank 1 once step ``kill_at`` is logged (0: never)."""

    kill_at = 0
    actors_before: dict[str, int] = {}

    def _log_and_checkpoint(self, metrics: dict[str, float]) -> None:
        super()._log_and_checkpoint(metrics)
        if self.step == self.kill_at:
            self.actors_before = processes(self.roles.groups, "spmdcall Actor")
            for pid in processes(self.roles.groups, "spmdcall HFRollout 1/2").values():
                os.kill(pid, signal.SIGKILL)


class ScalingTrainer(AsyncPPOTrainer):
    """Asks for 2 rollout workers after step ``grow_at`` and for 1 after step ``shrink_at``."""

    grow_at = shrink_at = 0

    def _log_and_checkpoint(self, metrics: dict[str, float]) -> None:
        super()._log_and_checkpoint(metrics)
        if self.step in (self.grow_at, self.shrink_at):
            self.scale_rollout(2 if self.step == self.grow_at else 1)


def scaled(steps: int, grow_at: int, shrink_at: int, run_dir: Path) -> dict:
    overrides = [*RUN, f"trainer.total_steps={steps}", f"trainer.run_dir={run_dir}"]
    overrides += ["trainer.rollout_workers=1", "trainer.rollout_workers_max=2"]
    trainer = ScalingTrainer(load_config(PPOConfig, "tiny-cpu", overrides))
    trainer.grow_at, trainer.shrink_at = grow_at, shrink_at
    with trainer:
        trainer.fit()
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "timing/step_s" in r]
    samples = trainer.config.data.train_batch_size * trainer.config.rollout.n
    phases = {}
    for name, first, last in (
        ("1 worker", 2, grow_at),
        ("2 workers", grow_at + 2, shrink_at),
        ("1 again", shrink_at + 2, steps),
    ):
        part = [r for r in rows if first <= r["step"] <= last]  # the step after each change left out
        phases[name] = {
            "world_size": statistics.mean(r["rollout/world_size"] for r in part),
            "gen_samples_per_s": statistics.median(samples / r["async/generate_s"] for r in part),
            "steps_per_s": len(part) / sum(r["timing/step_s"] for r in part),
        }
    return phases


def run(steps: int, kill_at: int, run_dir: Path) -> dict:
    overrides = [*RUN, f"trainer.total_steps={steps}", f"trainer.run_dir={run_dir}"]
    trainer = KillingTrainer(load_config(PPOConfig, "tiny-cpu", overrides))
    trainer.kill_at = kill_at
    with trainer:
        start = time.perf_counter()
        trainer.fit()
        wall = time.perf_counter() - start
        actors_after = processes(trainer.roles.groups, "spmdcall Actor")
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "timing/step_s" in r]
    spans = read_jsonl(run_dir / "timeline.jsonl")
    return {
        "killed_at": kill_at,
        "wall_s": wall,
        "steps": [r["step"] for r in rows],
        "ranks_lost": sum(r.get("rollout/ranks_lost", 0) for r in rows),
        "replace_s": [s["end"] - s["start"] for s in spans if s["kind"] == "replace"],
        "actor_unchanged": not kill_at or actors_after == trainer.actors_before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--scale", default="", help="GROW,SHRINK: the scaling run instead")
    args = parser.parse_args()
    if args.scale:
        grow_at, shrink_at = map(int, args.scale.split(","))
        with tempfile.TemporaryDirectory() as tmp:
            phases = scaled(args.steps, grow_at, shrink_at, Path(tmp) / "scaled")
        for name, figures in phases.items():
            print(f"{name:10s} " + "  ".join(f"{k} {v:.2f}" for k, v in figures.items()))
        if args.out:
            args.out.write_text(json.dumps(phases, indent=1))
        return
    results: dict[str, list[dict]] = {"disturbed": [], "control": []}
    with tempfile.TemporaryDirectory() as tmp:
        run(args.steps, 0, Path(tmp) / "warm-up")  # not counted: the first run makes the warm templates
        for i in range(args.rounds):
            for name, kill_at in (("disturbed", args.kill_at), ("control", 0)):
                result = run(args.steps, kill_at, Path(tmp) / f"{name}-{i}")
                results[name].append(result)
                print(json.dumps({name: result}), flush=True)
    lost = statistics.median(d["wall_s"] for d in results["disturbed"]) - statistics.median(
        c["wall_s"] for c in results["control"]
    )
    replace = statistics.median(s for d in results["disturbed"] for s in d["replace_s"])
    print(f"time lost {lost:.2f} s; the replacement itself took {replace:.2f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results | {"lost_s": lost, "replace_s": replace}, indent=1))


if __name__ == "__main__":
    main()
