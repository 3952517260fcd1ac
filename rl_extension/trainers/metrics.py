"""Where training metrics go: the console (a progress bar), a JSONL file, TensorBoard, W&B, MLflow.

    tracker = Tracker(run_dir, loggers=["console", "jsonl", "tensorboard"], total_steps=100)
    timer = StageTimer()
    with timer("gen"):
        ...
    tracker.log({"reward/score": 0.5, **timer.pop()}, step=1)
    tracker.close()

``metrics.jsonl`` holds one JSON object per line: ``{"step": 1, "time": <unix s>, "<name>": value, ...}``;
``rl_extension.app.plot`` draws it. W&B and MLflow are used when listed and installed (a warning
otherwise); TensorBoard needs the ``tensorboard`` package.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["StageTimer", "Tracker", "mean_metrics", "read_jsonl", "truncate_jsonl"]

# Shown in the progress bar, in this order, when present.
_BAR_KEYS = {
    "reward/score": "score",
    "reward/accuracy": "acc",
    "val/accuracy": "val_acc",
    "actor/entropy": "ent",
    "actor/ppo_kl": "kl",
    "timing/step_s": "s/step",
}


class StageTimer:
    """Wall time of named stages; ``pop()`` returns ``{"timing/<stage>_s": seconds}`` and resets."""

    def __init__(self) -> None:
        self._times: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._times[stage] = self._times.get(stage, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out = {f"timing/{stage}_s": seconds for stage, seconds in self._times.items()}
        self._times = {}
        return out


def mean_metrics(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """Average the metric dicts returned by each rank (a ``DP_COMPUTE_METRIC`` call); a metric
    whose name ends in ``_max`` takes the largest value instead."""
    names = {name for metrics in per_rank for name in metrics}
    values = {name: [m[name] for m in per_rank if name in m] for name in sorted(names)}
    return {name: max(v) if name.endswith("_max") else sum(v) / len(v) for name, v in values.items()}


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file (a torn last line, from a killed run, is skipped)."""
    records = []
    path = Path(path)
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def truncate_jsonl(path: str | Path, max_step: int) -> None:
    """Drop records after ``max_step`` (a resumed run logs those steps again), atomically: a kill while
    this runs leaves the old file or the new one, never a part of either."""
    path = Path(path)
    if path.exists():
        kept = [r for r in read_jsonl(path) if r.get("step", 0) <= max_step]
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


class Tracker:
    """Sends each step's metrics to every configured logger.

    Args:
        run_dir: where metrics.jsonl and tensorboard/ go.
        loggers: any of console, jsonl, tensorboard, wandb, mlflow.
        project: W&B/MLflow project (experiment) name.
        experiment: the run's name.
        config: the run's configuration (a dict), recorded by W&B and MLflow.
        total_steps: length of the progress bar.
        initial_step: where a resumed run's bar starts.
        progress: tqdm, rich or none.
        log_every: print a full metrics line every this many steps (0: never).
    """

    def __init__(
        self,
        run_dir: str | Path,
        loggers: Sequence[str] = ("console", "jsonl"),
        *,
        project: str = "spmdcall-rl",
        experiment: str = "default",
        config: dict | None = None,
        total_steps: int = 0,
        initial_step: int = 0,
        progress: str = "tqdm",
        log_every: int = 10,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = list(loggers)
        self.log_every = log_every
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self._jsonl = open(self.jsonl_path, "a") if "jsonl" in self.loggers else None
        self._tb = self._wandb = self._mlflow = None
        if "tensorboard" in self.loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                warnings.warn(
                    "trainer.loggers has tensorboard but the tensorboard package is not installed "
                    "(pip install tensorboard); skipping it",
                    stacklevel=2,
                )
        if "wandb" in self.loggers:
            self._wandb = _optional("wandb")
            if self._wandb is not None:
                self._wandb.init(
                    project=project, name=experiment, config=config, dir=str(self.run_dir), resume="allow"
                )
        if "mlflow" in self.loggers:
            self._mlflow = _optional("mlflow")
            if self._mlflow is not None:
                self._mlflow.set_experiment(project)
                self._mlflow.start_run(run_name=experiment)
                if config:
                    self._mlflow.log_params(_flatten(config))
        self._console = "console" in self.loggers
        self._bar = _ProgressBar(progress if self._console else "none", total_steps, initial_step)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record one step's metrics (numbers; other values go to the JSONL file only)."""
        numbers = {
            k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self._jsonl is not None:
            record = {
                "step": step,
                "time": round(time.time(), 3),
                **{k: _json_safe(v) for k, v in metrics.items()},
            }
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for name, value in numbers.items():
                self._tb.add_scalar(name, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)
        if self._mlflow is not None:
            self._mlflow.log_metrics(
                {k.replace("@", "_"): v for k, v in numbers.items() if math.isfinite(v)}, step=step
            )
        self._bar.update(step, {short: numbers[k] for k, short in _BAR_KEYS.items() if k in numbers})
        if self._console and self.log_every and (step % self.log_every == 0 or "val/accuracy" in numbers):
            self.print(format_metrics(numbers, step))

    def sync(self) -> None:
        """Put the metrics.jsonl lines logged so far on disk (fsync), e.g. before a checkpoint that counts on them."""
        if self._jsonl is not None:
            self._jsonl.flush()
            os.fsync(self._jsonl.fileno())

    def print(self, text: str) -> None:
        """Print without breaking the progress bar."""
        self._bar.write(text)

    def close(self) -> None:
        self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()


def format_metrics(numbers: dict[str, float], step: int) -> str:
    """One console line: the headline metrics first, then the stage timings."""
    head = [f"step {step}"]
    for key in (
        "sft/loss",
        "reward/score",
        "reward/accuracy",
        "val/accuracy",
        "actor/entropy",
        "actor/ppo_kl",
        "actor/kl_loss",
        "actor/pg_clipfrac",
        "actor/grad_norm",
        "critic/vf_loss",
        "response/length_mean",
        "perf/tokens_per_s",
        "timing/step_s",
    ):
        if key in numbers:
            head.append(f"{key}={numbers[key]:.4g}")
    return " ".join(head)


class _ProgressBar:
    def __init__(self, kind: str, total: int, initial: int) -> None:
        self.kind = kind
        self._bar: Any = None
        if kind == "tqdm":
            from tqdm.auto import tqdm

            # disable=None: no bar when the output is not a terminal (logs get the metric lines only)
            self._bar = tqdm(
                total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, disable=None
            )
        elif kind == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self._task = self._bar.add_task("train", total=total, completed=initial, info="")
            self._bar.start()

    def update(self, step: int, shown: dict[str, float]) -> None:
        info = " ".join(f"{k}={v:.3g}" for k, v in shown.items())
        if self.kind == "tqdm":
            self._bar.n = step
            self._bar.set_postfix_str(info, refresh=False)
            self._bar.refresh()
        elif self.kind == "rich":
            self._bar.update(self._task, completed=step, info=info)

    def write(self, text: str) -> None:
        if self.kind == "tqdm":
            self._bar.write(text)  # prints plainly when the bar is disabled
        elif self.kind == "rich":
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.kind == "tqdm":
            self._bar.close()
        elif self.kind == "rich":
            self._bar.stop()


def _optional(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        warnings.warn(
            f"trainer.loggers has {module} but it is not installed (pip install {module}); skipping it",
            stacklevel=3,
        )
        return None


def _flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return value.item()
    return value
