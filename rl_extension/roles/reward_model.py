"""The reward model role: a sequence-classification model that scores prompt + response.

It reads the same token ids as the policy, so it must share the policy's tokenizer. The score of
a row is placed on its last response token (``rm_scores``, the layout of ``token_level_scores``).
"""

from __future__ import annotations

import torch

import spmdcall as sc
from rl_extension import fsdp
from rl_extension.config import ModelConfig, RewardConfig
from rl_extension.roles.keys import SCORE_KEYS
from spmdcall.data import DataProto

__all__ = ["RewardModel"]


class RewardModel(sc.Worker):
    """Scalar scores from an FSDP2-sharded ``AutoModelForSequenceClassification`` (num_labels=1).

    Args:
        model: dtype and attention kernel.
        config: checkpoint path (reward.model_path) and micro-batch size.
        threads: torch threads (0: a share of the cores).
        use_gpu: run on this rank's GPU.
    """

    def __init__(self, model: ModelConfig, config: RewardConfig, *, threads: int = 0, use_gpu: bool = False):
        self.config = config
        self.device = fsdp.setup_worker(threads, use_gpu)
        model = fsdp.resolve_precision(model, self.device)
        self.model = fsdp.shard(  # frozen: loaded in the compute dtype
            fsdp.load_model(model, config.model_path, self.device, kind="reward", dtype=model.compute_dtype)
        ).eval()
        self.model.requires_grad_(False)
        # HF pools each row at its last token that is not the pad id; every position outside the
        # attention mask is set to that id below, so the pooled token is the last response token.
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.model.config.eos_token_id
        self.pad_token_id = self.model.config.pad_token_id
        if isinstance(self.pad_token_id, list):
            self.pad_token_id = self.model.config.pad_token_id = self.pad_token_id[0]

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    @torch.no_grad()
    def compute_rm_score(self, batch: DataProto) -> DataProto:
        """``rm_scores`` (rows, response_len): each row's score on its last response token."""
        data = batch.select(batch_keys=SCORE_KEYS, non_tensor_batch_keys=[]).to(self.device)
        parts = []
        for micro in data.split(self.config.micro_batch_size_per_worker):
            attention_mask = micro.batch["attention_mask"]
            input_ids = micro.batch["input_ids"].masked_fill(attention_mask == 0, self.pad_token_id)
            score = (
                self.model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=micro.batch["position_ids"],
                    use_cache=False,
                )
                .logits[:, 0]
                .float()
            )
            mask = micro.batch["response_mask"]
            last = mask.shape[1] - 1 - mask.flip(1).argmax(dim=1)
            scores = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
            scores[torch.arange(len(micro)), last] = torch.where(mask.sum(1) > 0, score, 0.0)
            parts.append(scores.cpu())
        return DataProto.from_dict({"rm_scores": torch.cat(parts)})
