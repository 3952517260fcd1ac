"""``AgentRollout``: the agent loop as the trainer sees it, prompts in, trajectories out as one batch.

It stands where ``rollout.generate`` stands in ``PPOTrainer.fit`` and returns the same columns (see
``roles/rollout.py``), so rewards, log-probs, advantages and updates need nothing new:

- ``responses`` holds the model's turns *and* the tool observations between them;
- ``response_mask`` is 1 on the model's tokens only (every turn's eos included), 0 on observations
  and padding: the policy loss, the KL terms, the entropy and the advantages see model tokens only;
- ``attention_mask`` is 1 on every real token, observations included (the model reads them);
- non-tensor columns ``num_turns``, ``num_tool_calls``, ``num_tool_errors``, ``finish_reason``.

The loop runs in the controller, on an event loop of its own, and reaches the rollout engine on the
workers through the group method ``generate_turns`` (``TURNS_DISPATCH``).
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import numpy as np
import torch

from rl_extension.agents.formats import format_for
from rl_extension.agents.loop import AgentLoop, Trajectory, TurnClient
from rl_extension.agents.tools import Tool, get_tool
from rl_extension.agents.turns import Sampling
from rl_extension.config import MultiTurnConfig, RolloutConfig
from spmdcall.data import DataProto

__all__ = ["AgentRollout", "agent_metrics", "trajectory_batch"]


class AgentRollout:
    """Generate with the agent loop: ``generate(prompts)`` as ``rollout.generate`` does, ``n`` trajectories per prompt.

    Args:
        group: the rollout group (or colocated view) with a ``generate_turns`` method.
        tokenizer: the policy's tokenizer.
        config: the rollout section (sampling, ``n``, ``max_new_tokens``, ``multi_turn``).
        max_in_flight: group calls in flight at once (1: HF, which serves one batch at a time; 0: vLLM).
        seed: seeds sampling, with each prompt's ``uid``.

    Example:
        >>> agent = AgentRollout(roles.rollout, tokenizer, config.rollout, max_in_flight=1)  # doctest: +SKIP
        >>> batch = agent.generate(prompts)
    """

    def __init__(
        self, group: Any, tokenizer: Any, config: RolloutConfig, *, max_in_flight: int, seed: int = 0
    ):
        self.config = config
        self.multi_turn: MultiTurnConfig = config.multi_turn
        self.tokenizer = tokenizer
        self.seed = seed
        self.tools: dict[str, Tool] = {t.name: t for t in map(get_tool, self.multi_turn.tools)}
        self.fmt = format_for(tokenizer, self.multi_turn.format)
        self.client = TurnClient(group.generate_turns.submit, group.world_size, max_in_flight)
        self.loop = AgentLoop(self.client, tokenizer, self.fmt, self.tools, self.multi_turn)
        self._event_loop = asyncio.new_event_loop()

    def tool_schemas(self) -> list[dict]:
        """The tools as chat templates take them (``apply_chat_template(..., tools=...)``)."""
        return [t.schema() for t in self.tools.values()]

    def generate(self, prompts: DataProto) -> DataProto:
        """``n`` trajectories per prompt (interleaved), columns as in the module docstring.

        ``meta_info`` options as ``rollout.generate``'s: ``validate`` (greedy unless
        rollout.val_temperature > 0), ``n``, ``temperature``, ``do_sample``.
        """
        cfg, meta = self.config, prompts.meta_info
        validate = bool(meta.get("validate", False))
        n = int(meta.get("n", cfg.val_n if validate else cfg.n))
        temperature = float(meta.get("temperature", cfg.val_temperature if validate else cfg.temperature))
        do_sample = bool(meta.get("do_sample", temperature > 0))
        sampling = Sampling(
            temperature=temperature if do_sample else 1.0,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            greedy=not do_sample,
            log_probs=cfg.compute_log_probs and not validate,
        )
        rows = prompts.repeat(n, interleave=True) if n > 1 else prompts
        ids, keep = rows.batch["input_ids"], rows.batch["attention_mask"].bool()
        uids = rows.non_tensor_batch.get("uid", np.arange(len(rows)).astype(str))
        # A trajectory's seed comes from its prompt's uid and its sample number, so it samples the
        # same after a resume, and does not depend on which turns share a batch.
        seeds = [_seed(self.seed, str(uid), i % n) for i, uid in enumerate(uids)]
        trajectories = self._event_loop.run_until_complete(
            self.loop.run(
                [row[k].tolist() for row, k in zip(ids, keep)],
                max_new_tokens=cfg.max_new_tokens,
                sampling=sampling,
                seeds=seeds,
            )
        )
        out = trajectory_batch(
            rows, trajectories, cfg.max_new_tokens, self.tokenizer.pad_token_id, sampling.log_probs
        )
        out.meta_info.update({"temperature": sampling.temperature, "n": n, "validate": validate})
        return out

    def close(self) -> None:
        self._event_loop.close()


def _seed(seed: int, uid: str, sample: int) -> int:
    return zlib.crc32(f"{seed}/{uid}/{sample}".encode()) * 65536 + sample


def trajectory_batch(
    prompts: DataProto,
    trajectories: list[Trajectory],
    max_new_tokens: int,
    pad_token_id: int,
    log_probs: bool = False,
) -> DataProto:
    """The batch of ``rollout.generate``'s columns for one trajectory per prompt row.

    Args:
        prompts: the prompt rows (left-padded ``input_ids``, ``attention_mask``, ``position_ids``).
        trajectories: one per row, in order.
        max_new_tokens: the width of ``responses``.
        pad_token_id: fills ``responses`` after each trajectory.
        log_probs: add ``rollout_log_prob`` (the sampling log-probs of model tokens, 0 elsewhere).
    """
    rows = len(trajectories)
    responses = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, max_new_tokens), dtype=torch.long)
    real = torch.zeros((rows, max_new_tokens), dtype=torch.long)
    sampled = torch.zeros((rows, max_new_tokens), dtype=torch.float32)
    versions = torch.full((rows, max_new_tokens), -1, dtype=torch.long)
    for i, t in enumerate(trajectories):
        length = len(t.response_ids)
        responses[i, :length] = torch.tensor(t.response_ids, dtype=torch.long)
        response_mask[i, :length] = torch.tensor(t.mask, dtype=torch.long)
        real[i, :length] = 1
        sampled[i, :length] = torch.tensor(t.log_probs, dtype=torch.float32)
        versions[i, :length] = torch.tensor(t.versions, dtype=torch.long)
    prompt_ids, prompt_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    last_prompt_pos = prompts.batch["position_ids"][:, -1:]
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, real], dim=1),
        "position_ids": torch.cat(
            [
                prompts.batch["position_ids"],
                last_prompt_pos + torch.arange(1, max_new_tokens + 1).unsqueeze(0),
            ],
            dim=1,
        ),
        "policy_version": versions,  # per token: the version of the weights that sampled its turn
    }
    if log_probs:
        tensors["rollout_log_prob"] = torch.where(response_mask.bool(), sampled, 0.0)
    columns = {
        "num_turns": np.array([t.num_turns for t in trajectories], dtype=np.int64),
        "num_tool_calls": np.array([t.num_tool_calls for t in trajectories], dtype=np.int64),
        "num_tool_errors": np.array([t.num_tool_errors for t in trajectories], dtype=np.int64),
        "finish_reason": np.array([t.finish_reason for t in trajectories], dtype=object),
    }
    return DataProto.from_dict(tensors, {**prompts.non_tensor_batch, **columns})


def agent_metrics(batch: DataProto, prefix: str = "agent/") -> dict[str, float]:
    """Tool use of a batch made by ``AgentRollout`` (nothing for another batch): tool calls and turns
    per trajectory, the share of calls that failed, how trajectories ended, observation tokens."""
    columns = batch.non_tensor_batch
    if "num_tool_calls" not in columns:
        return {}
    calls, errors = (
        columns["num_tool_calls"].astype(np.float64),
        columns["num_tool_errors"].astype(np.float64),
    )
    prompt_width = batch.batch["prompts"].shape[1]
    observed = batch.batch["attention_mask"][:, prompt_width:].sum(-1) - batch.batch["response_mask"].sum(-1)
    metrics = {
        f"{prefix}tool_calls_per_traj": float(calls.mean()),
        f"{prefix}tool_error_rate": float(errors.sum() / calls.sum()) if calls.sum() else 0.0,
        f"{prefix}turns_per_traj": float(columns["num_turns"].astype(np.float64).mean()),
        f"{prefix}observation_tokens_mean": observed.float().mean().item(),
    }
    for reason in ("answer", "max_turns", "length"):
        metrics[f"{prefix}finish_{reason}_frac"] = float((columns["finish_reason"] == reason).mean())
    return metrics
