"""FSDP2 helpers shared by the roles that hold sharded models (actor, reference, critic, reward model, SFT).

Every worker of a group calls these together: they are SPMD code, and most of them run collectives.

    device = setup_worker(threads=0)                       # torch threads, torch.distributed
    model = shard(load_model(model_config, path, device))  # fully_shard every decoder layer, then the root
    optimizer, scheduler = build_optimizer(model, lr=1e-5), ...
    model, optimizer, scheduler = build_training(model_config, path, optim, device, total_steps=100)  # all three
    save_checkpoint(path, model, optimizer, scheduler)     # sharded (torch.distributed.checkpoint)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import spmdcall as sc
from rl_extension.config import ModelConfig
from rl_extension.config.optimizer import OptimizerConfig

__all__ = [
    "build_optimizer",
    "build_scheduler",
    "build_training",
    "clip_grad_norm",
    "copy_tokenizer_files",
    "gathered_params",
    "load_checkpoint",
    "load_model",
    "resolve_precision",
    "rng_state",
    "save_checkpoint",
    "save_hf_model",
    "set_rng_state",
    "setup_worker",
    "shard",
]


def setup_worker(threads: int = 0, use_gpu: bool = False, distributed: bool = True) -> torch.device:
    """Pin this worker's torch threads, join torch.distributed (gloo or nccl), return its device.

    Args:
        threads: torch threads; 0 gives each worker on this machine an equal share of the cores.
        use_gpu: use the GPU of this rank (LOCAL_RANK) and nccl.
        distributed: join the group's process group (a role whose ranks never talk to each other
            skips it, so one of its ranks can be restarted alone).
    """
    if threads <= 0:
        threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    torch.set_num_threads(threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per model load and rank would drown the trainer's output
    if use_gpu and not torch.cuda.is_available():
        raise RuntimeError("trainer.use_gpu=true but torch sees no CUDA device in this worker")
    if distributed:
        sc.init_distributed("nccl" if use_gpu else "gloo")
    elif use_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")


ModelKind = Literal["causal_lm", "value", "reward"]


def resolve_precision(config: ModelConfig, device: torch.device) -> ModelConfig:
    """``config`` with ``auto`` in compute_dtype and attn_implementation replaced for this device.

    bfloat16 where the hardware computes it natively: a CUDA GPU that supports it, a CPU with AMX
    tiles; model.dtype elsewhere. Attention: eager for a 16-bit compute dtype on CPU, sdpa otherwise.
    Every role calls this after ``setup_worker``, so colocated roles agree.
    """
    compute_dtype = config.compute_dtype
    if compute_dtype == "auto":
        if device.type == "cuda":
            native = torch.cuda.is_bf16_supported()
        else:
            native = device.type == "cpu" and torch.cpu._is_amx_tile_supported()
        compute_dtype = "bfloat16" if native else ""
    attn = config.attn_implementation
    if attn == "auto":
        sixteen_bit = (compute_dtype or config.dtype) in ("bfloat16", "float16")
        attn = "eager" if device.type == "cpu" and sixteen_bit else "sdpa"
    return dataclasses.replace(config, compute_dtype=compute_dtype, attn_implementation=attn)


def load_model(
    config: ModelConfig,
    path: str,
    device: torch.device,
    kind: ModelKind = "causal_lm",
    dtype: str = "",
) -> torch.nn.Module:
    """Load a Hugging Face model for one role.

    Args:
        config: dtype, attention kernel, remote-code permission.
        path: the checkpoint.
        device: where the model goes before sharding.
        kind: ``causal_lm`` (policy, reference), ``value`` (a causal LM backbone with a scalar
            head per token, for the critic), ``reward`` (a scalar per sequence).
        dtype: overrides ``config.dtype`` (a rollout's copy loads in ``config.compute_dtype``).
    """
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )
    from transformers.utils import logging as hf_logging

    cls = {
        "causal_lm": AutoModelForCausalLM,
        "value": AutoModelForTokenClassification,
        "reward": AutoModelForSequenceClassification,
    }[kind]
    kwargs: dict[str, Any] = {
        "dtype": getattr(torch, dtype or config.dtype),
        "trust_remote_code": config.trust_remote_code,
        "attn_implementation": config.attn_implementation,
    }
    if kind != "causal_lm":
        kwargs["num_labels"] = 1
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a value head on an LM checkpoint is "newly initialised" by design
    try:
        model = cls.from_pretrained(path, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    if kind == "value":
        # Values start at 0 everywhere instead of at random: the first advantages are then the
        # plain discounted rewards and the critic does not push the policy around while it warms up.
        head = model.score if hasattr(model, "score") else model.classifier
        torch.nn.init.zeros_(head.weight)
        if getattr(head, "bias", None) is not None:
            torch.nn.init.zeros_(head.bias)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model.to(device)


def shard(
    model: torch.nn.Module,
    reshard_after_forward: bool = True,
    fsdp_size: int = -1,
    compute_dtype: str = "",
) -> torch.nn.Module:
    """``fully_shard`` every transformer block (the model's ``_no_split_modules``), then the root.

    Args:
        reshard_after_forward: free the gathered parameters after each forward.
        fsdp_size: ranks each parameter is sharded over; -1 means all ranks. A smaller size gives
            hybrid sharding (HSDP): groups of ``fsdp_size`` ranks hold one sharded copy each and
            gradients are all-reduced across the copies; 1 replicates the model on every rank
            (DDP-like: no all-gathers, for models that fit on one rank many times over).
        compute_dtype: mixed precision: the gathered parameters (and so the forward and backward)
            are in this dtype, while the shards, the gradient reduction and the optimizer stay in
            the model's dtype; empty means the model's dtype.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    size = world if fsdp_size == -1 else fsdp_size
    if size < 1 or world % size:
        raise ValueError(f"fsdp_size={fsdp_size} must be -1 (all ranks) or divide the world size {world}")
    mesh = None
    if size != world:
        from torch.distributed.device_mesh import init_device_mesh

        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("replicate", "shard"))
    param_dtype = next(model.parameters()).dtype
    mp_policy = MixedPrecisionPolicy()
    if compute_dtype and getattr(torch, compute_dtype) != param_dtype:
        mp_policy = MixedPrecisionPolicy(param_dtype=getattr(torch, compute_dtype), reduce_dtype=param_dtype)
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    return model


def build_optimizer(
    model: torch.nn.Module,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] | list[float] = (0.9, 0.999),
) -> torch.optim.Optimizer:
    """AdamW over the (sharded) parameters that require gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    # foreach: torch picks it by default only for CUDA tensors. On CPU the per-parameter loop runs
    # every op through DTensor's dispatch one parameter at a time, a large share of a small model's
    # step; the multi-tensor ops do the same arithmetic in a few calls (docs/rl/experiment-log.md).
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), foreach=True)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    schedule: str = "constant",
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup, then constant or cosine decay to ``min_lr_ratio``; stepped once per training step."""
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"lr schedule must be 'constant' or 'cosine', got {schedule!r}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_training(
    model_config: ModelConfig,
    path: str,
    optim: OptimizerConfig,
    device: torch.device,
    *,
    total_steps: int,
    kind: ModelKind = "causal_lm",
    reshard_after_forward: bool = True,
    fsdp_size: int = -1,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """A model to train on this worker: loaded, sharded, with its AdamW and learning-rate schedule.

    The actor, the critic and SFT build theirs with it; ``optim`` is their config section (the keys
    of ``OptimizerConfig``), the other arguments go to ``load_model`` and ``shard``.

    Returns:
        (model, optimizer, scheduler).
    """
    model_config = resolve_precision(model_config, device)
    model = shard(
        load_model(model_config, path, device, kind=kind),
        reshard_after_forward,
        fsdp_size,
        compute_dtype=model_config.compute_dtype,
    )
    optimizer = build_optimizer(model, optim.lr, optim.weight_decay, optim.betas)
    scheduler = build_scheduler(
        optimizer,
        total_steps=total_steps,
        warmup_steps=optim.warmup_steps,
        schedule=optim.lr_schedule,
        min_lr_ratio=optim.min_lr_ratio,
    )
    return model, optimizer, scheduler


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (over every shard) and return it; ``max_norm <= 0`` only measures it."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor when the parameters are sharded
        norm = norm.full_tensor()
    return float(norm)


@contextlib.contextmanager
def gathered_params(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """The full parameters of an FSDP2 model by name (tied ones under every name), valid inside the block.

    With mixed precision (``shard(..., compute_dtype=...)``) they are in the compute dtype.

    Every rank gets every tensor: each ``fully_shard``ed module all-gathers its shards in place
    (``unshard``) and frees them again on exit (``reshard``). No state-dict copy is made, so this
    is the cheap way to hand weights to a colocated rollout engine every step. A collective.

        with gathered_params(actor_model) as params:
            torch._foreach_copy_(dst_tensors, [params[n] for n in names])
    """
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    handles = [m.unshard(async_op=True) for m in modules]
    for handle in handles:
        if handle is not None:
            handle.wait()
    try:
        yield {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}
    finally:
        for m in modules:
            m.reshard()


def local_pieces(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> dict[str, tuple[torch.Tensor, tuple[int, ...], int]] | None:
    """This rank's rows of every parameter of an FSDP2 model sharded on one mesh dimension, with
    no collective: name -> (local rows, in ``dtype`` if given; the whole shape; the first row).
    None when a parameter is placed otherwise (replicated, HSDP): then only a gather gives them.
    Tied parameters once, under their first name (as ``named_parameters`` lists them)."""
    from torch.distributed.tensor import DTensor, Shard

    pieces = {}
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) or p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            return None
        world, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
        rows = p.shape[0]
        chunk = -(-rows // world)  # FSDP2 splits dim 0 as torch.chunk does
        start = min(rank * chunk, rows)
        local = p.to_local().detach()
        assert local.shape[0] == min(chunk, rows - start), (name, tuple(local.shape), rows, world)
        pieces[name] = (local if dtype is None else local.to(dtype), tuple(p.shape), start)
    return pieces


def rng_state() -> dict:
    """This process's random states (python, numpy, torch, cuda)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    extra: dict | None = None,
) -> None:
    """Save sharded weights and optimizer state (torch.distributed.checkpoint), plus per-rank extras.

    Each rank writes its own shards, so no rank ever holds the whole model. ``extra`` (anything
    picklable: RNG states, counters) is saved per rank next to the shards.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
    else:
        state = {"model": get_model_state_dict(model)}
    dcp.save(state, checkpoint_id=str(path / "shards"))
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(
        {"scheduler": None if scheduler is None else scheduler.state_dict(), "extra": extra or {}},
        path / f"rank_{rank}.pt",
    )


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
) -> dict:
    """Load what ``save_checkpoint`` wrote (resharding if the world size changed); returns this rank's extras."""
    path = Path(path)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=str(path / "shards"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(path / "shards"))
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    rank = dist.get_rank() if dist.is_initialized() else 0
    rank_file = path / f"rank_{rank}.pt"
    if not rank_file.exists():  # resumed on more ranks than were saved: start from rank 0's extras
        rank_file = path / "rank_0.pt"
    saved = torch.load(rank_file, weights_only=False)
    if scheduler is not None and saved["scheduler"] is not None:
        scheduler.load_state_dict(saved["scheduler"])
    return saved["extra"]


def save_hf_model(model: torch.nn.Module, path: str | os.PathLike, tokenizer_path: str | None = None) -> None:
    """Gather the full weights and write a Hugging Face checkpoint from rank 0 (all ranks must call it)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state_dict = get_model_state_dict(model, options=options)
    if dist.get_rank() != 0:
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, state_dict=state_dict)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    if tokenizer_path:
        copy_tokenizer_files(tokenizer_path, path)


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy a local checkpoint's tokenizer files as they are (re-saving could change their format)."""
    import shutil

    for name in _TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
