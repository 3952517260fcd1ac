"""``OptimizerConfig``: the AdamW and learning-rate-schedule keys of every section that trains a model.

``actor``, ``critic`` and the SFT config inherit these fields (so the keys stay ``actor.lr``,
``critic.lr``, ``lr``), and ``fsdp.build_training`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from rl_extension.config.ranges import Fraction, NonNegativeFloat, NonNegativeInt, Range
from rl_extension.config.schema import Section

__all__ = ["OptimizerConfig"]


@dataclass(kw_only=True)
class OptimizerConfig(Section):
    """AdamW, gradient clipping and the learning-rate schedule."""

    lr: NonNegativeFloat = 1e-5
    """Peak learning rate of AdamW."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay."""
    betas: list[Annotated[float, Range(ge=0, lt=1)]] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Learning rate after warmup: constant, or cosine decay to min_lr_ratio * lr at the last step."""
    warmup_steps: NonNegativeInt = 0
    """Linear warmup from 0, in training steps."""
    min_lr_ratio: Fraction = 0.0
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    grad_clip: NonNegativeFloat = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    def check(self, prefix: str = "") -> None:
        """Raise ValueError on betas that are not two numbers (each value's own range is in its type)."""
        super().check(prefix)
        if len(self.betas) != 2:
            raise ValueError(f"{prefix}betas must hold two numbers [beta1, beta2], got {self.betas!r}")
