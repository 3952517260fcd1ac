"""What the trained roles (actor, critic) share: an FSDP2 model with its optimizer and schedule,
the settings of their mini-batch updates, and their checkpoints."""

from __future__ import annotations

import spmdcall as sc
from rl_extension import fsdp
from rl_extension.config import ActorConfig, CriticConfig, ModelConfig

__all__ = ["TrainedRole"]


class TrainedRole(sc.Worker):
    """Base of ``Actor`` and ``Critic``: builds the model (``fsdp.build_training``) and checkpoints it.

    Args:
        model: dtype, attention kernel, gradient checkpointing.
        config: the role's section (optimizer, schedule and loss settings).
        model_path: the checkpoint to start from.
        num_mini_batches: optimizer steps per pass over a step's batch (train_batch_size / ppo_mini_batch_size).
        total_steps: training steps, for the learning-rate schedule.
        seed: seeds the mini-batch shuffles.
        threads: torch threads (0: a share of the cores).
        use_gpu: train on this rank's GPU.
        **shard: ``reshard_after_forward`` and ``fsdp_size`` for ``fsdp.shard``.
    """

    model_kind: fsdp.ModelKind = "causal_lm"
    """What ``fsdp.load_model`` builds on the checkpoint (the critic: a value head)."""

    def __init__(
        self,
        model: ModelConfig,
        config: ActorConfig | CriticConfig,
        *,
        model_path: str,
        num_mini_batches: int,
        total_steps: int,
        seed: int = 0,
        threads: int = 0,
        use_gpu: bool = False,
        **shard: bool | int,
    ):
        self.config = config
        self.num_mini_batches = num_mini_batches
        self.seed = seed
        self.device = fsdp.setup_worker(threads, use_gpu)
        self.model, self.optimizer, self.scheduler = fsdp.build_training(
            model, model_path, config, self.device, total_steps=total_steps, kind=self.model_kind, **shard
        )
        self.num_updates = 0  # update calls so far: seeds the shuffles, survives checkpoints

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Sharded weights, optimizer and scheduler state under ``path`` (every rank writes its shards)."""
        fsdp.save_checkpoint(
            path, self.model, self.optimizer, self.scheduler, extra={"num_updates": self.num_updates}
        )

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote."""
        extra = fsdp.load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.num_updates = extra.get("num_updates", 0)
