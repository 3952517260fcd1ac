"""``SFTConfig``: supervised fine-tuning, the warm start before RL (``spmdcall-rl sft``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Annotated

from rl_extension.config.data import DataConfig
from rl_extension.config.model import ModelConfig
from rl_extension.config.multi_turn import MultiTurnConfig
from rl_extension.config.optimizer import OptimizerConfig
from rl_extension.config.ranges import (
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Range,
)
from rl_extension.config.schema import check_scorer
from rl_extension.config.trainer import ranks_in_controller
from rl_extension.user_code import import_modules

__all__ = ["SFTConfig"]


@dataclass(kw_only=True)
class SFTConfig(OptimizerConfig):
    """Supervised fine-tuning (warm start): prompt -> answer + eos, loss on the answer tokens only.

    The optimizer keys (lr, betas, lr_schedule, ...) are inherited from ``OptimizerConfig``; steps are SFT steps."""

    imports: list[str] = field(default_factory=list)
    """Your modules, imported before the config is checked: dotted names importable from sys.path, or paths of .py files. What they register (an advantage estimator, a policy loss, a scorer, a tool-call format, a tool) can then be named in this config (docs/rl/custom_reward_and_data.md)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to fine-tune (``tiny`` builds a random one)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt/answer files (data.train_files, data.val_files) or data.synthetic; batch sizes are the keys below."""
    output_dir: str = "runs/sft"
    """Where the Hugging Face checkpoint (output_dir/hf_model) and metrics.jsonl go."""
    total_steps: PositiveInt = 1000
    """Optimizer steps."""
    batch_size: PositiveInt = 64
    """Examples per step, split over the workers."""
    micro_batch_size_per_worker: NonNegativeInt = 0
    """Examples per forward/backward on one worker; 0 means all of its share at once."""
    eval_every: NonNegativeInt = 0
    """Greedy held-out accuracy every this many steps (and at the end); 0 only at the end."""
    max_new_tokens: PositiveInt = 64
    """Response length limit of the evaluation."""
    eval_scorer: str = ""
    """Scorer of the evaluation (a registered name or module:function); empty picks one per row by its data_source."""
    stop_at_accuracy: Fraction = 0.0
    """Stop early once an evaluation (every eval_every steps) reaches this held-out accuracy; 0 never stops early."""
    max_minutes: NonNegativeFloat = 0.0
    """Stop after the step that passes this many minutes of training, evaluating there (an SFT control
    given the same minutes as an RL run); 0 never stops early."""
    backend: str = "process"
    """spmdcall backend (process, ray; inline with num_workers=1)."""
    num_workers: PositiveInt = 2
    """Data-parallel FSDP2 workers."""
    fsdp_size: Annotated[int, Range(ge=1, also=(-1,))] = -1
    """FSDP2: ranks each parameter is sharded over; -1 all of them; 1 replicates the model (as actor.fsdp_size)."""
    use_gpu: bool = False
    """One GPU per worker."""
    threads_per_worker: NonNegativeInt = 0
    """torch threads per worker; 0 divides the cores among the workers."""
    seed: NonNegativeInt = 0
    """Seeds the data order and the model's dropout."""
    log_every: NonNegativeInt = 100
    """Print the loss every this many steps."""
    call_timeout_s: PositiveFloat = 600.0
    """Seconds after which a worker call raises instead of hanging."""
    max_restarts: NonNegativeInt = 0
    """Times the run recovers by itself from a dead rank or a call past call_timeout_s: it restarts
    the group and trains again from step 0 (SFT keeps no checkpoints); 0 raises at once."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Tool-using demonstrations: with enable, each answer is a whole trajectory whose tool results
    (found by the format) are left out of the loss, and the evaluation runs the agent loop with the tools."""

    def validate(self) -> None:
        """Raise ValueError naming the key of a value outside its declared range or at odds with others;
        warn about values that will be ignored. The modules of ``imports`` are imported first, so
        the names they register pass."""
        import_modules(self.imports)
        self.check()
        defaults = DataConfig()
        ignored = [
            f"data.{k}"
            for k in ("train_batch_size", "shuffle")
            if getattr(self.data, k) != getattr(defaults, k)
        ]
        if ignored:
            warnings.warn(
                f"{', '.join(ignored)} ignored by SFT: it samples batch_size examples per step", stacklevel=3
            )

    def check(self, prefix: str = "") -> None:
        """Every section checks its own keys; then the batch must split over the workers."""
        super().check(prefix)
        if self.batch_size % self.num_workers:
            raise ValueError(
                f"{prefix}batch_size={self.batch_size} must split evenly over {prefix}num_workers={self.num_workers}"
            )
        if self.num_workers != 1 and ranks_in_controller(self.backend):
            raise ValueError(
                f"the {self.backend} backend needs {prefix}num_workers=1 (FSDP collectives), got {self.num_workers}"
            )
        check_scorer(f"{prefix}eval_scorer", self.eval_scorer)
        if self.stop_at_accuracy and not self.eval_every:
            raise ValueError(
                f"{prefix}stop_at_accuracy needs {prefix}eval_every > 0 (how often the accuracy is measured)"
            )
