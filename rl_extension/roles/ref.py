"""The reference policy: a frozen, FSDP2-sharded copy of the starting policy for KL terms."""

from __future__ import annotations

import torch

import spmdcall as sc
from rl_extension import fsdp
from rl_extension.config import ModelConfig, RefConfig
from rl_extension.roles.actor import response_log_probs
from rl_extension.roles.keys import FORWARD_KEYS
from spmdcall.data import DataProto

__all__ = ["Reference"]


class Reference(sc.Worker):
    """Log-probs of responses under the frozen starting policy.

    Args:
        model: dtype and attention kernel.
        config: micro-batch size.
        model_path: the reference checkpoint.
        threads: torch threads (0: a share of the cores).
        use_gpu: run on this rank's GPU.
    """

    def __init__(
        self,
        model: ModelConfig,
        config: RefConfig,
        *,
        model_path: str,
        threads: int = 0,
        use_gpu: bool = False,
    ):
        self.config = config
        self.device = fsdp.setup_worker(threads, use_gpu)
        model = fsdp.resolve_precision(model, self.device)
        # Nothing to optimise: the frozen copy is simply loaded in the compute dtype.
        self.model = fsdp.shard(
            fsdp.load_model(model, model_path, self.device, dtype=model.compute_dtype)
        ).eval()
        self.model.requires_grad_(False)

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    @torch.no_grad()
    def compute_log_prob(self, batch: DataProto) -> DataProto:
        """``ref_log_prob`` (rows, response_len), at the temperature in ``meta_info`` like the actor's."""
        temperature = batch.meta_info.get("temperature", 1.0)
        data = batch.select(batch_keys=FORWARD_KEYS, non_tensor_batch_keys=[]).to(self.device)
        parts = [
            response_log_probs(self.model, micro, temperature)[0].cpu()
            for micro in data.split(self.config.log_prob_micro_batch_size_per_worker)
        ]
        return DataProto.from_dict({"ref_log_prob": torch.cat(parts)})
