"""The critic: a value model (causal-LM backbone + scalar head per token), FSDP2-sharded, for GAE."""

from __future__ import annotations

import time

import numpy as np
import torch

import spmdcall as sc
from rl_extension.algorithms.core import compute_value_loss, masked_mean
from rl_extension.roles.keys import CRITIC_UPDATE_KEYS, SCORE_KEYS
from rl_extension.roles.minibatch import update_in_mini_batches
from rl_extension.roles.trained import TrainedRole
from spmdcall.data import DataProto

__all__ = ["Critic"]


def response_values(model: torch.nn.Module, batch: DataProto) -> torch.Tensor:
    """The value of the state before each response token, (rows, response_len)."""
    response_len = batch.batch["responses"].shape[1]
    out = model(
        input_ids=batch.batch["input_ids"],
        attention_mask=batch.batch["attention_mask"],
        position_ids=batch.batch["position_ids"],
        use_cache=False,
    )
    # Same alignment as the log-probs: position t holds the state in which token t + 1 is chosen.
    return out.logits[:, -response_len - 1 : -1, 0].float()


class Critic(TrainedRole):
    """Values for GAE and clipped value-loss updates; the arguments are ``TrainedRole``'s (its
    ``model_path`` is a causal-LM backbone, whose value head starts at zero)."""

    model_kind = "value"

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    @torch.no_grad()
    def compute_values(self, batch: DataProto) -> DataProto:
        """``values`` (rows, response_len), zero outside the response mask."""
        self.model.eval()
        data = batch.select(batch_keys=SCORE_KEYS, non_tensor_batch_keys=[]).to(self.device)
        parts = [
            (response_values(self.model, micro) * micro.batch["response_mask"]).cpu()
            for micro in data.split(self.config.micro_batch_size_per_worker)
        ]
        return DataProto.from_dict({"values": torch.cat(parts)})

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_METRIC)
    def update_critic(self, batch: DataProto) -> dict[str, float]:
        """Value-loss epochs over this rank's rows (needs ``values`` and ``returns``); returns mean metrics."""
        cfg, start = self.config, time.perf_counter()
        self.model.train()
        data = batch.select(batch_keys=CRITIC_UPDATE_KEYS, non_tensor_batch_keys=[]).to(self.device)
        metrics = update_in_mini_batches(
            self.model,
            self.optimizer,
            data,
            self._micro_step,
            num_epochs=cfg.ppo_epochs,
            num_mini_batches=self.num_mini_batches,
            micro_batch_size=cfg.micro_batch_size_per_worker,
            grad_clip=cfg.grad_clip,
            rng=np.random.default_rng([self.seed, self.num_updates, self.rank, 1]),
            prefix="critic",
        )
        self.num_updates += 1
        metrics["critic/lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        metrics["timing/critic_update_worker_s"] = time.perf_counter() - start
        return metrics

    def _micro_step(self, micro: DataProto, weight: float) -> dict[str, float]:
        """Forward and backward of the clipped value loss on one micro-batch; its metrics."""
        cfg, mask = self.config, micro.batch["response_mask"]
        vpreds = response_values(self.model, micro)
        loss, clipfrac = compute_value_loss(
            vpreds,
            micro.batch["returns"],
            micro.batch["values"],
            mask,
            cfg.cliprange_value,
            cfg.loss_agg_mode,
        )
        (loss * weight).backward()
        return {
            "critic/vf_loss": loss.item(),
            "critic/vf_clipfrac": clipfrac.item(),
            "critic/vpred_mean": masked_mean(vpreds.detach(), mask).item(),
        }
