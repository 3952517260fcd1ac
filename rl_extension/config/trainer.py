"""The ``trainer`` section: where a run writes, how long it runs, on which backend, what it logs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rl_extension.config.ranges import NonNegativeInt, PositiveFloat, PositiveInt
from rl_extension.config.schema import Section

__all__ = ["LOGGERS", "TrainerConfig"]

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
"""The names ``trainer.loggers`` accepts."""


@dataclass(kw_only=True)
class TrainerConfig(Section):
    """The run: where it writes, how long, on which backend, what it logs and when it checkpoints."""

    project: str = "spmdcall-rl"
    """Project name (TensorBoard/W&B/MLflow grouping)."""
    experiment: str = "default"
    """Experiment name; the run dir defaults to runs/<experiment>."""
    run_dir: str = ""
    """Where config.yaml, metrics.jsonl, TensorBoard events, plots and checkpoints go; empty means runs/<experiment>."""
    total_steps: PositiveInt = 100
    """Training steps (one batch of prompts each)."""
    backend: str = "process"
    """spmdcall backend: process (local processes), ray, or inline (one process, world size 1, for debugging)."""
    num_workers: PositiveInt = 2
    """Processes of the actor/rollout/reference pool (the data-parallel size)."""
    use_gpu: bool = False
    """One GPU per worker (nccl); false runs on CPU with gloo."""
    threads_per_worker: NonNegativeInt = 0
    """torch threads in each worker; 0 divides the machine's cores among the workers."""
    seed: NonNegativeInt = 0
    """Seeds the data order, the models' sampling and the mini-batch shuffles."""
    val_every: NonNegativeInt = 20
    """Validate every this many steps (and after the last); 0 never."""
    val_before_train: bool = True
    """Validate once before the first step (the starting accuracy)."""
    save_every: NonNegativeInt = 50
    """Checkpoint every this many steps (and after the last); 0 only after the last."""
    max_checkpoints: NonNegativeInt = 2
    """Keep this many newest checkpoints; 0 keeps all."""
    resume: bool = False
    """Continue from the run dir's latest checkpoint (a fresh start if there is none)."""
    overwrite: bool = False
    """Allow starting from scratch in a run dir that already holds a run (its files are replaced)."""
    save_hf_model: bool = True
    """Also write the final policy as a Hugging Face checkpoint (run_dir/hf_model)."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Where metrics go: console, jsonl, tensorboard, wandb, mlflow (the last three if installed)."""
    progress: Literal["tqdm", "rich", "none"] = "tqdm"
    """Progress bar style on the console."""
    log_every: NonNegativeInt = 10
    """Print a metrics line every this many steps (the progress bar updates every step)."""
    call_timeout_s: PositiveFloat = 600.0
    """Seconds after which any worker call raises CallTimeoutError instead of hanging."""
    max_restarts: NonNegativeInt = 0
    """Times a run recovers by itself from a dead rank or a call past call_timeout_s: it restarts every
    group, reloads the latest checkpoint (saved every save_every steps) and goes on; 0 raises at once."""

    def check(self, prefix: str = "") -> None:
        """Raise ValueError on an unknown logger, or on the inline backend with more than one worker."""
        super().check(prefix)
        unknown = sorted(set(self.loggers) - set(LOGGERS))
        if unknown:
            raise ValueError(f"{prefix}loggers: unknown {unknown}; choose from {', '.join(LOGGERS)}")
        if self.backend == "inline" and self.num_workers != 1:
            raise ValueError(
                "the inline backend runs every rank in turn in this process, so FSDP collectives "
                f"between ranks would deadlock: use {prefix}num_workers=1 with it (got {self.num_workers})"
            )
