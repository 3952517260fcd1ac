"""The ``model`` section: which checkpoint every role loads, its dtypes, and the tiny test model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rl_extension.config.ranges import NonNegativeInt, PositiveInt
from rl_extension.config.schema import Section

__all__ = ["MIN_HEAD_DIM", "ModelConfig", "TinyModelConfig"]

# vLLM's CPU attention kernels reject heads narrower than this (a tiny model's hidden_size / num_heads).
MIN_HEAD_DIM = 32


@dataclass(kw_only=True)
class TinyModelConfig(Section):
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
class ModelConfig(Section):
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

    def check(self, prefix: str = "") -> None:
        """Raise ValueError if ``path`` is empty or the tiny model's sizes (used when path is ``tiny``) do not fit together."""
        if not self.path:
            raise ValueError(
                f"{prefix}path is empty: give a Hugging Face checkpoint (a directory or Hub name), "
                f"or {prefix}path=tiny for a random tiny model"
            )
        super().check(prefix)
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
