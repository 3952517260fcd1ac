"""The sections of the roles: ``actor``, ``rollout``, ``ref``, ``critic`` and ``reward``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from rl_extension.config.multi_turn import MultiTurnConfig
from rl_extension.config.optimizer import OptimizerConfig
from rl_extension.config.ranges import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Range,
)
from rl_extension.config.schema import Section, check_registered, check_scorer

__all__ = ["ActorConfig", "CriticConfig", "RefConfig", "RewardConfig", "RolloutConfig"]


@dataclass(kw_only=True)
class ActorConfig(OptimizerConfig):
    """The policy trainer (FSDP2): policy loss, optimizer (inherited keys) and learning-rate schedule."""

    lr: NonNegativeFloat = 1e-6
    """Peak learning rate of AdamW."""
    ppo_epochs: PositiveInt = 1
    """Passes over each step's batch."""
    ppo_mini_batch_size: PositiveInt = 32
    """Prompts per optimizer step (times rollout.n rows); train_batch_size / ppo_mini_batch_size steps per pass."""
    micro_batch_size_per_worker: PositiveInt = 8
    """Rows per forward/backward on one worker (gradient accumulation); bounds memory."""
    shuffle: bool = True
    """Shuffle rows into mini-batches (seeded)."""
    policy_loss: str = "ppo"
    """Policy loss: ppo (the clipped surrogate below), or a loss registered with @register_policy_loss (rl_extension.algorithms.policy_losses)."""
    clip_ratio_low: Annotated[float, Range(ge=0, lt=1)] = 0.2
    """PPO clip: the ratio may fall to 1 - clip_ratio_low."""
    clip_ratio_high: NonNegativeFloat = 0.2
    """PPO clip: the ratio may rise to 1 + clip_ratio_high (raise it for clip-higher / DAPO)."""
    clip_ratio_c: Annotated[float, Range(gt=1)] = 3.0
    """Dual-clip bound for negative advantages (> 1)."""
    off_policy_correction: Literal["none", "tis", "decoupled"] = "none"
    """Correct the policy loss for tokens sampled by another policy than old_log_prob's (rollout_log_prob's, e.g. a stale or lower-precision rollout; needs rollout.compute_log_probs): tis multiplies each token's loss by min(exp(old_log_prob - rollout_log_prob), importance_weight_cap); decoupled is decoupled PPO (AReaL): the clip on pi/pi_prox (pi_prox: old_log_prob, recomputed by the actor), weighted by min(pi_prox/pi_behav, importance_weight_cap), pi_behav the rollout's. none: off."""
    importance_weight_cap: PositiveFloat = 2.0
    """actor.off_policy_correction: the truncation C of the importance weights (detached)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How per-token losses are averaged."""
    entropy_coeff: float = 0.0
    """Entropy bonus: loss -= entropy_coeff * entropy."""
    sft_loss_coef: NonNegativeFloat = 0.0
    """Supervised term of the update (mixed in as PPO-ptx and CHORD do): loss += sft_loss_coef * the
    mean negative log-likelihood of each step prompt's demonstration (data.demonstration_key's column,
    or else the ground truth), written as a response in a row of its own that the policy loss, KL and
    entropy leave out. A task's data must hold demonstrations; 0 turns it off."""
    use_kl_loss: bool = False
    """Add a KL(policy || reference) loss term (GRPO style); needs the reference model."""
    kl_loss_coef: NonNegativeFloat = 0.001
    """Weight of the KL loss."""
    kl_loss_type: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "low_var_kl"
    """KL estimator of the KL loss (see rl_extension.algorithms.kl.kl_penalty)."""
    log_prob_micro_batch_size_per_worker: PositiveInt = 16
    """Rows per forward when computing log-probs (no gradient)."""
    always_compute_old_log_prob: bool = False
    """Run the separate old_log_prob forward even when each epoch is one mini-batch, where the update's first forward gives the same values (and later epochs reuse them)."""
    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after each forward (less memory, one more all-gather)."""
    fsdp_size: Annotated[int, Range(ge=1, also=(-1,))] = -1
    """FSDP2: ranks each parameter is sharded over; -1 all of them. Smaller: hybrid sharding (HSDP), copies all-reduce their gradients; 1 replicates the model (DDP-like, for small models)."""

    def check(self, prefix: str = "") -> None:
        """Raise ValueError on a policy loss that is not registered, or that cannot take the
        off-policy correction asked for (each value's own range is in its type)."""
        super().check(prefix)
        from rl_extension.algorithms.policy_losses import get_policy_loss  # that module imports this one

        check_registered(f"{prefix}policy_loss", self.policy_loss, get_policy_loss)
        correction = self.off_policy_correction
        if correction == "decoupled" and self.policy_loss != "ppo":
            raise ValueError(
                f"{prefix}off_policy_correction=decoupled is the ppo loss's clip on pi/pi_prox; "
                f"{prefix}policy_loss={self.policy_loss!r} must be 'ppo' (or use off_policy_correction=tis)"
            )
        if correction == "tis" and not get_policy_loss(self.policy_loss).takes_token_weights:
            raise ValueError(
                f"{prefix}off_policy_correction=tis needs a policy loss that takes token_weights; "
                f"{prefix}policy_loss={self.policy_loss!r} was registered without takes_token_weights=True"
            )


@dataclass(kw_only=True)
class RolloutConfig(Section):
    """Sampling responses from the policy."""

    name: Literal["hf", "vllm"] = "hf"
    """Rollout engine: hf (transformers generate on a colocated copy of the policy) or vllm (a vLLM engine in each actor process, weights synced in place)."""
    n: PositiveInt = 8
    """Responses sampled per prompt (the GRPO group size)."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature (also applied to the actor's log-probs, so the ratio is on-policy)."""
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    """Nucleus sampling threshold."""
    top_k: NonNegativeInt = 0
    """Sample among the k most likely tokens; 0 disables."""
    max_new_tokens: PositiveInt = 512
    """Response length limit in tokens; responses stop earlier at an eos token."""
    val_temperature: NonNegativeFloat = 0.0
    """Validation sampling temperature; 0 is greedy."""
    val_n: PositiveInt = 1
    """Responses per validation prompt."""
    micro_batch_size_per_worker: NonNegativeInt = 0
    """Prompts generated at once on one worker; 0 means all of its share."""
    compute_log_probs: bool = False
    """Also return the sampling log-probs (rollout_log_prob), e.g. to measure the rollout/actor mismatch."""
    verify_weights: Literal["auto", "always", "never"] = "auto"
    """Async mode: each rollout rank checks the checksum of every weight tensor it loads from the actor (an error names the first that differs); auto: where it costs at most a tenth of the sync (a rollout on GPU, or a load of at most 16 MiB)."""
    tensor_parallel_size: PositiveInt = 1
    """vLLM: ranks (GPUs) sharing one engine; trainer.num_workers must be a multiple. Ranks of one engine get the same prompts."""
    gpu_memory_utilization: Annotated[float, Range(gt=0, le=1)] = 0.5
    """vLLM on GPU: fraction of the GPU's memory for the engine's weights and KV cache (the rest is the actor's)."""
    kv_cache_memory_bytes: NonNegativeInt = 0
    """vLLM: KV-cache size in bytes; 0 means gpu_memory_utilization decides on GPU, 1 GiB on CPU."""
    max_model_len: NonNegativeInt = 0
    """vLLM: longest prompt + response in tokens; 0 means the model's max_position_embeddings."""
    enforce_eager: bool = True
    """vLLM: no torch.compile and no CUDA graphs (fast start; set false on GPU for faster decoding)."""
    enable_sleep_mode: bool = False
    """vLLM on GPU: free the KV cache and offload the weights to CPU between generations (sleep level 1), so training gets the memory."""
    engine_kwargs: dict = field(default_factory=dict)
    """vLLM: extra keyword arguments of vllm.LLM, e.g. {max_num_seqs: 256}."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn, tool-using rollouts (the agent loop)."""

    def check(self, prefix: str = "") -> None:
        """Raise ValueError where the agent loop meets a vLLM setting it cannot serve."""
        super().check(prefix)
        if self.multi_turn.enable and self.name == "vllm" and self.tensor_parallel_size > 1:
            # The ranks of one engine would each see the requests in their own arrival order.
            raise ValueError(f"{prefix}multi_turn needs {prefix}tensor_parallel_size=1 with vllm")


@dataclass(kw_only=True)
class RefConfig(Section):
    """The frozen reference policy (used by the KL loss or the KL reward penalty)."""

    path: str = ""
    """Checkpoint of the reference; empty means the policy's starting model.path."""
    log_prob_micro_batch_size_per_worker: PositiveInt = 16
    """Rows per forward."""


@dataclass(kw_only=True)
class CriticConfig(OptimizerConfig):
    """The value model (FSDP2, causal-LM backbone + scalar head); used when algorithm.adv_estimator is gae."""

    path: str = ""
    """Checkpoint of the backbone; empty means the policy's model.path."""
    placement: Literal["colocated", "separate"] = "colocated"
    """colocated: in the actor's processes; separate: a pool of its own (critic.num_workers)."""
    num_workers: NonNegativeInt = 0
    """Processes of a separate critic pool; 0 means trainer.num_workers."""
    ppo_epochs: PositiveInt = 1
    """Passes over each step's batch."""
    ppo_mini_batch_size: PositiveInt = 32
    """Prompts per optimizer step (times rollout.n rows)."""
    micro_batch_size_per_worker: PositiveInt = 8
    """Rows per forward/backward on one worker."""
    cliprange_value: NonNegativeFloat = 0.5
    """Clipped value loss: predictions move at most this far from the rollout-time values."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How per-token value losses are averaged."""


@dataclass(kw_only=True)
class RewardConfig(Section):
    """How responses are scored: rule-based scorers in the controller, and/or a reward model."""

    scorer: str = ""
    """Scorer: a name registered with @register_scorer (rl_extension.data.scorers) or ``module:function``; empty picks one per row by its data_source."""
    scorer_kwargs: dict = field(default_factory=dict)
    """Keyword arguments bound to the scorer (e.g. {format_score: 0.1})."""
    rule_weight: float = 1.0
    """Weight of the rule-based score in the reward (0: reward model only)."""
    model_path: str = ""
    """Sequence-classification reward model checkpoint; empty means no reward model."""
    model_weight: float = 1.0
    """Weight of the reward model's score in the reward."""
    placement: Literal["colocated", "separate"] = "colocated"
    """Reward model in the actor's processes, or a pool of its own."""
    num_workers: NonNegativeInt = 0
    """Processes of a separate reward-model pool; 0 means trainer.num_workers."""
    micro_batch_size_per_worker: PositiveInt = 16
    """Rows per reward-model forward."""

    def check(self, prefix: str = "") -> None:
        """Raise ValueError on a scorer name that is not registered (``module:function`` is imported at the run's start)."""
        super().check(prefix)
        check_scorer(f"{prefix}scorer", self.scorer)
