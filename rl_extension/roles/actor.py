"""The actor: the policy being trained, sharded with FSDP2 over the workers of its pool.

Rows arrive as a DataProto (one slice per worker, ``Dispatch.DP_COMPUTE_PROTO``) holding the
sequences a rollout produced: ``input_ids`` / ``attention_mask`` / ``position_ids`` over
prompt + response, ``responses`` and ``response_mask`` over the response only. ``meta_info``
carries per-call options: ``temperature`` (the sampling temperature, so that log-probs are those
of the distribution the rollout sampled from).
"""

from __future__ import annotations

import time

import numpy as np
import torch

import spmdcall as sc
from rl_extension import fsdp
from rl_extension.algorithms.core import agg_loss, entropy_from_logits, logprobs_from_logits
from rl_extension.algorithms.kl import kl_penalty
from rl_extension.algorithms.policy_losses import PolicyLoss, get_policy_loss, policy_loss_with_correction
from rl_extension.config import ActorConfig, ModelConfig
from rl_extension.roles.keys import ACTOR_UPDATE_KEYS, FORWARD_KEYS
from rl_extension.roles.minibatch import update_in_mini_batches
from rl_extension.roles.trained import TrainedRole
from rl_extension.roles.weight_sync import Publishers, canary_meta, commit_parts
from spmdcall.data import DataProto, TensorPiece, WeightGeneration

__all__ = ["Actor", "PUBLISHED", "RANK_ZERO_RESULT", "response_log_probs"]


def _rank_zero_result(group: object, outputs: list) -> object:
    return outputs[0]


RANK_ZERO_RESULT = sc.register_dispatch_mode(
    "rl_extension.rank_zero_result", sc.Dispatch.ONE_TO_ALL.dispatch_fn, _rank_zero_result
)
"""Every rank runs the call (a collective) with the same arguments; the result is rank 0's alone."""

PUBLISHED = sc.register_dispatch_mode(
    "rl_extension.published_weights", sc.Dispatch.ONE_TO_ALL.dispatch_fn, commit_parts
)
"""Every rank runs the call with the same arguments and writes its part of a weight generation; the
controller commits the parts (``weight_sync.commit_parts``) and the result is the generation."""


def response_log_probs(
    model: torch.nn.Module, batch: DataProto, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the response tokens under ``model``, shape (rows, response_len).

    The logit at position t predicts token t + 1, so the response's log-probs come from the
    ``response_len`` positions before the last one; only those logits are computed.
    """
    responses = batch.batch["responses"]
    response_len = responses.shape[1]
    out = model(
        input_ids=batch.batch["input_ids"],
        attention_mask=batch.batch["attention_mask"],
        position_ids=batch.batch["position_ids"],
        use_cache=False,
        logits_to_keep=response_len + 1,
    )
    logits = out.logits[:, :-1].float() / temperature
    log_prob = logprobs_from_logits(logits, responses)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return log_prob, entropy


class Actor(TrainedRole):
    """The FSDP2 policy: log-probs, policy-loss updates with mini/micro-batches, checkpoints.

    Args:
        model, config, model_path, num_mini_batches, total_steps, seed, threads, use_gpu: see ``TrainedRole``.
        policy_loss: the registered policy loss that actor.policy_loss names (``get_policy_loss``);
            None: looked up here, in the worker (the trainer passes the controller's, so that a loss
            registered in the driver script alone reaches the workers).
    """

    def __init__(
        self,
        model: ModelConfig,
        config: ActorConfig,
        *,
        model_path: str,
        num_mini_batches: int,
        total_steps: int,
        seed: int = 0,
        threads: int = 0,
        use_gpu: bool = False,
        policy_loss: PolicyLoss | None = None,
    ):
        super().__init__(
            model,
            config,
            model_path=model_path,
            num_mini_batches=num_mini_batches,
            total_steps=total_steps,
            seed=seed,
            threads=threads,
            use_gpu=use_gpu,
            reshard_after_forward=config.reshard_after_forward,
            fsdp_size=config.fsdp_size,
        )
        self.policy_loss = get_policy_loss(config.policy_loss) if policy_loss is None else policy_loss
        self.publishers = Publishers()  # for publish_weights
        compute_dtype = fsdp.resolve_precision(model, self.device).compute_dtype
        self.weights_dtype = getattr(torch, compute_dtype) if compute_dtype else None  # as gathered

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    @torch.no_grad()
    def compute_log_prob(self, batch: DataProto) -> DataProto:
        """``old_log_prob`` (rows, response_len) of the responses under the current policy."""
        self.model.eval()
        temperature = batch.meta_info.get("temperature", 1.0)
        parts = [
            response_log_probs(self.model, micro, temperature)[0].cpu()
            for micro in self._on_device(batch, FORWARD_KEYS).split(
                self.config.log_prob_micro_batch_size_per_worker
            )
        ]
        return DataProto.from_dict({"old_log_prob": torch.cat(parts)})

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_METRIC)
    def update_policy(self, batch: DataProto) -> dict[str, float]:
        """PPO epochs over this rank's rows in mini-batches (one optimizer step each); returns mean metrics.

        Needs ``advantages`` and ``response_mask`` besides the forward keys, ``ref_log_prob`` when
        ``actor.use_kl_loss`` is on, and ``old_log_prob`` unless each epoch is a single mini-batch:
        then the first epoch's forwards run on the weights that sampled, so their log-probs are the
        old ones, kept for the later epochs. Rows with an ``sft_mask`` (actor.sft_loss_coef's
        demonstrations) add its supervised term.
        """
        cfg, start = self.config, time.perf_counter()
        if "old_log_prob" not in batch.batch.keys() and self.num_mini_batches > 1:
            raise ValueError(
                f"update_policy needs old_log_prob with num_mini_batches={self.num_mini_batches}: "
                "only the first mini-batch runs on the weights that sampled"
            )
        self.model.train()
        optional = tuple(
            k
            for k in ("old_log_prob", "ref_log_prob", "sft_mask", "rollout_log_prob")
            if k in batch.batch.keys()
        )
        data = self._on_device(batch, ACTOR_UPDATE_KEYS + optional)
        temperature = batch.meta_info.get("temperature", 1.0)
        first_pass: list[torch.Tensor] = []  # an epoch's log-probs, in its row order

        def micro_step(micro: DataProto, weight: float) -> dict[str, float]:
            metrics, log_prob = self._micro_step(micro, temperature, weight)
            first_pass.append(log_prob)
            return metrics

        def keep_old_log_prob(order: np.ndarray) -> None:
            # Without old_log_prob the first epoch ran on the weights that sampled: its log-probs
            # are the old ones for the later epochs.
            if "old_log_prob" not in data.batch.keys():
                old_log_prob = torch.empty_like(data.batch["response_mask"], dtype=first_pass[0].dtype)
                old_log_prob[torch.as_tensor(order, device=old_log_prob.device)] = torch.cat(first_pass)
                data.batch["old_log_prob"] = old_log_prob
            first_pass.clear()

        metrics = update_in_mini_batches(
            self.model,
            self.optimizer,
            data,
            micro_step,
            num_epochs=cfg.ppo_epochs,
            num_mini_batches=self.num_mini_batches,
            micro_batch_size=cfg.micro_batch_size_per_worker,
            grad_clip=cfg.grad_clip,
            rng=np.random.default_rng([self.seed, self.num_updates, self.rank]) if cfg.shuffle else None,
            prefix="actor",
            between_epochs=keep_old_log_prob,
        )
        self.num_updates += 1
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        metrics["timing/actor_update_worker_s"] = time.perf_counter() - start
        if self.device.type == "cuda":  # the peak of this process (every colocated role) so far
            metrics["perf/max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return metrics

    def _micro_step(
        self, micro: DataProto, temperature: float, weight: float
    ) -> tuple[dict[str, float], torch.Tensor]:
        """Forward and backward of one micro-batch: its metrics and its log-probs (detached)."""
        cfg = self.config
        mask = micro.batch["response_mask"]
        log_prob, entropy = response_log_probs(self.model, micro, temperature, with_entropy=True)
        # Without old_log_prob this is the first epoch of a one-mini-batch update: the weights that
        # sampled are these.
        old_log_prob = (
            micro.batch["old_log_prob"] if "old_log_prob" in micro.batch.keys() else log_prob.detach()
        )
        pg_loss, pg_metrics = policy_loss_with_correction(
            self.policy_loss,
            cfg,
            old_log_prob,
            log_prob,
            micro.batch["advantages"],
            mask,
            micro.batch["rollout_log_prob"] if "rollout_log_prob" in micro.batch.keys() else None,
        )
        entropy_loss = agg_loss(entropy, mask, cfg.loss_agg_mode)
        loss = pg_loss - cfg.entropy_coeff * entropy_loss
        metrics = {
            "actor/pg_loss": pg_loss.item(),
            **{f"actor/{name}": value.item() for name, value in pg_metrics.items()},
            "actor/entropy": entropy_loss.item(),
        }
        if cfg.use_kl_loss:
            kl = agg_loss(
                kl_penalty(log_prob, micro.batch["ref_log_prob"], cfg.kl_loss_type), mask, cfg.loss_agg_mode
            )
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.item()
        if "sft_mask" in micro.batch.keys() and micro.batch["sft_mask"].any():
            # The demonstrations' negative log-likelihood, a token mean (actor.sft_loss_coef).
            sft_loss = agg_loss(-log_prob, micro.batch["sft_mask"], "token-mean")
            loss = loss + cfg.sft_loss_coef * sft_loss
            metrics["actor/sft_loss"] = sft_loss.item()
        (loss * weight).backward()
        return metrics, log_prob.detach()

    def _on_device(self, batch: DataProto, keys: tuple[str, ...]) -> DataProto:
        return batch.select(batch_keys=keys, non_tensor_batch_keys=[]).to(self.device)

    @sc.register(dispatch_mode=RANK_ZERO_RESULT)
    @torch.no_grad()
    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """The full policy weights as one state dict (HF checkpoint names, tied weights once), on CPU.

        For a rollout in a group of its own (asynchronous training): every rank takes part in the
        all-gather (``fsdp.gathered_params``), rank 0 alone copies the weights out and returns them,
        and the others return None, so one copy crosses to the controller (``RANK_ZERO_RESULT``).
        With mixed precision they are in the compute dtype, as a colocated ``sync_weights`` gets
        them. Pass the result, or its future, to a rollout's ``load_weights``.

        Example:
            >>> rollout.load_weights(actor.export_weights.submit(), version=3)  # doctest: +SKIP
        """
        with fsdp.gathered_params(self.model) as gathered:
            if self.rank != 0:
                return None
            # named_parameters lists a tied weight once, under its first name, as the rollouts do.
            return {name: gathered[name].to("cpu", copy=True) for name, _ in self.model.named_parameters()}

    @sc.register(dispatch_mode=PUBLISHED)
    @torch.no_grad()
    def publish_weights(self, version: int, root: str, canary_atol: float = 0.0) -> WeightGeneration | None:
        """Publish the full policy weights into the weight store at ``root`` (``sc.WeightStore``)
        as a new generation; the group call returns its metadata (``WeightGeneration``).

        Each rank writes its own FSDP shard (its rows of every tensor, in the compute dtype) into
        shared memory it keeps across syncs, only what changed since the slot last held it, with
        no all-gather; the controller commits the parts. A model sharded otherwise (HSDP,
        replicated) is gathered and written by rank 0. Pass the result to a rollout's
        ``load_weights``: the bytes go from the store to the rollout ranks, never through the
        controller. With ``canary_atol`` > 0 the generation carries the log-probs of a fixed token
        sequence for the rollouts to check (``weight_sync.check_canary``).

        Example:
            >>> gen = actor.publish_weights(3, store.root)  # doctest: +SKIP
            >>> rollout.load_weights(gen, version=3)  # doctest: +SKIP
        """
        meta = canary_meta(self.model, self.device, canary_atol)  # a forward: every rank takes part
        pieces = fsdp.local_pieces(self.model, self.weights_dtype)
        if pieces is not None:
            parts = {name: TensorPiece(*piece) for name, piece in pieces.items()}
            return self.publishers.write(root, self.rank, parts, version, meta)
        with fsdp.gathered_params(self.model) as gathered:
            if self.rank != 0:
                return None
            named = {name: gathered[name] for name, _ in self.model.named_parameters()}
            return self.publishers.write(root, 0, named, version, meta)

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def save_hf_model(self, path: str, tokenizer_path: str = "") -> None:
        """The current policy as a Hugging Face checkpoint (written by rank 0)."""
        fsdp.save_hf_model(self.model, path, tokenizer_path or None)
