"""PPOTrainer: the single controller of a PPO/GRPO run.

The controller holds the loop and the cheap math (rewards, advantages); every model lives in a
worker group. By default one pool of ``trainer.num_workers`` processes holds the actor, the rollout
and the reference, fused with ``sc.colocate`` (one process per rank, so the rollout takes the
actor's weights in-process); the critic and the reward model join that pool or get their own.

    config = load_config(PPOConfig, preset="tiny-cpu", overrides=["trainer.total_steps=50"])
    summary = PPOTrainer(config).fit()

One step, as ``_train_step`` reads: prompts -> rollout.generate -> rewards -> actor/ref log-probs ->
values -> advantages -> critic update -> actor update -> rollout weight sync -> log, validate, save.
"""

from __future__ import annotations

import pickle
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from rl_extension.advantages import get_advantage_estimator
from rl_extension.agents import AgentRollout, agent_metrics, tool_schemas
from rl_extension.agents.calc import tokenize_demonstration
from rl_extension.algorithms import (
    failed_group_rows,
    informative_rows,
    masked_mean,
    pick_groups,
    uniform_group_fraction,
    uniform_groups,
)
from rl_extension.config import PPOConfig, to_dict
from rl_extension.data import PromptLoader, datasets_from_config
from rl_extension.inputs import check_inputs
from rl_extension.kl import apply_kl_penalty, get_kl_controller
from rl_extension.metrics import StageTimer, Tracker, mean_metrics, truncate_jsonl
from rl_extension.models import load_tokenizer, resolve_model_path
from rl_extension.rewards import RewardManager, get_scorer
from rl_extension.roles import ROLLOUTS
from rl_extension.roles.groups import build_roles
from rl_extension.roles.keys import ACTOR_UPDATE_KEYS, CRITIC_UPDATE_KEYS, FORWARD_KEYS, SCORE_KEYS
from rl_extension.roles.rollout import concat_rollouts, replace_responses
from rl_extension.run_dir import (
    CHECKPOINT_DIR,
    latest_checkpoint,
    prepare_run_dir,
    publish_checkpoint,
    run_with_restarts,
)
from spmdcall.data import DataProto

__all__ = ["PPOTrainer"]


class PPOTrainer:
    """Builds the worker groups and data of a run from a PPOConfig, then ``fit()`` trains.

    Args:
        config: the run's configuration (``load_config(PPOConfig, ...)``).

    Example:
        >>> trainer = PPOTrainer(load_config(PPOConfig, "tiny-cpu"))  # doctest: +SKIP
        >>> trainer.fit()["val/accuracy"]
    """

    mode = "sync"  # the trainer.mode this class runs (AsyncPPOTrainer: async)

    def __init__(self, config: PPOConfig):
        config.validate()
        if config.trainer.mode != self.mode:
            wanted = "AsyncPPOTrainer" if config.trainer.mode == "async" else "PPOTrainer"
            raise ValueError(
                f"trainer.mode={config.trainer.mode} needs {wanted}, not {type(self).__name__}: "
                "build the trainer with rl_extension.async_trainer.make_trainer(config)"
            )
        check_inputs(config)  # a missing checkpoint or data file fails here, before the run dir is touched
        self.config = config
        self.run_dir = prepare_run_dir(config)
        self.model_path = resolve_model_path(config.model, self.run_dir)
        self.tokenizer_path = config.model.tokenizer_path or self.model_path
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        self.train_loader, self.val_batches = self._build_data()
        scorer = (
            get_scorer(config.reward.scorer, **config.reward.scorer_kwargs) if config.reward.scorer else None
        )
        self.reward_manager = RewardManager(self.tokenizer, scorer)
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = get_kl_controller(
            kl.kind, kl.kl_coef, *((kl.target_kl, kl.horizon) if kl.kind == "adaptive" else ())
        )
        self.step = 0
        self.timer = StageTimer()
        self.tracker: Tracker | None = None
        self.roles = build_roles(config, self.model_path, self.tokenizer_path)
        # rollout.multi_turn: the agent loop (rl_extension.agents) generates, on the rollout's engine.
        self.agent = self._agent_rollout()

    def _agent_rollout(self) -> AgentRollout | None:
        """An agent loop on the rollout's engine where ``rollout.multi_turn`` is on, else None."""
        cfg = self.config
        if not cfg.rollout.multi_turn.enable:
            return None
        max_in_flight = ROLLOUTS[cfg.rollout.name].TURN_CALLS_IN_FLIGHT
        return AgentRollout(
            self.roles.rollout,
            self.tokenizer,
            cfg.rollout,
            max_in_flight=max_in_flight,
            seed=cfg.trainer.seed,
        )

    # -- the loop ------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        """Train until ``trainer.total_steps``; returns the last step's metrics (validation included).

        With ``trainer.max_restarts``, a dead rank (``WorkerDiedError``) or a call past
        ``trainer.call_timeout_s`` (``CallTimeoutError``) restarts the groups, reloads the latest
        checkpoint and goes on in this process (``_recover``); with no restarts left it raises."""
        cfg = self.config
        start = self._controller_state()  # where a recovery before the first checkpoint starts again
        self.resume()
        self.tracker = self._make_tracker()
        metrics: dict[str, float] = {}
        try:
            metrics = run_with_restarts(
                self._train,
                lambda n: self._recover(n, start),
                cfg.trainer.max_restarts,
                where=lambda: f"step {self.step + 1}",
            )
            if cfg.trainer.save_hf_model:
                self.roles.actor.save_hf_model(str(self.run_dir / "hf_model"), self.tokenizer_path)
        finally:
            self.tracker.close()
        return metrics

    def _train(self) -> dict[str, float]:
        """Steps from ``self.step`` to ``trainer.total_steps`` (validating first on a fresh start)."""
        cfg, metrics = self.config.trainer, {}
        assert self.tracker is not None
        if cfg.val_before_train and self.step == 0 and self.val_batches:
            self.tracker.log(self.validate(), step=0)
        batches = self._prompt_batches()
        while self.step < cfg.total_steps:
            metrics = self._train_step(batches)
            if _due(self.step, cfg.val_every, cfg.total_steps) and self.val_batches:
                metrics |= self.validate()
            self._log_and_checkpoint(metrics)
        return metrics

    def _train_step(self, batches: Iterator[DataProto]) -> dict[str, float]:
        """One PPO step on the groups; returns its metrics (timings included) with ``self.step`` advanced."""
        cfg, roles, t = self.config, self.roles, self.timer
        with t("step"):
            batch, metrics = self._generate_and_score(batches)  # timed as gen and reward
            if cfg.compute_old_log_prob:
                with t("old_log_prob"):
                    batch = batch.union(roles.actor.compute_log_prob(_pick(batch, FORWARD_KEYS)))
            if roles.ref is not None:
                with t("ref_log_prob"):
                    batch = batch.union(roles.ref.compute_log_prob(_pick(batch, FORWARD_KEYS)))
            if roles.critic is not None:
                with t("values"):
                    batch = batch.union(roles.critic.compute_values(_pick(batch, SCORE_KEYS)))
            with t("adv"):
                metrics |= self._advantages(batch)
            if roles.critic is not None:
                with t("update_critic"):
                    metrics |= mean_metrics(roles.critic.update_critic(_pick(batch, CRITIC_UPDATE_KEYS)))
            with t("update_actor"):
                actor_batch = self._actor_batch(batch)
                metrics["actor/update_row_frac"] = len(actor_batch) / len(batch)
                metrics |= mean_metrics(roles.actor.update_policy(actor_batch))
            with t("sync_weights"):
                self._sync_rollout(self.step + 1)
        self.step += 1
        metrics |= self.timer.pop()
        return metrics | _batch_metrics(batch, cfg.rollout.max_new_tokens, metrics)

    # -- the steps -----------------------------------------------------------------------------

    def _sync_rollout(self, version: int) -> None:
        """The rollout takes the actor's current weights (``version``: the actor updates they hold)."""
        self.roles.rollout.sync_weights()

    def _generate(self, prompts: DataProto) -> DataProto:
        """The rollout's responses; with rollout.multi_turn, the agent loop's trajectories (same columns)."""
        return self.agent.generate(prompts) if self.agent else self.roles.rollout.generate(prompts)

    def _generate_and_score(self, batches: Iterator[DataProto]) -> tuple[DataProto, dict[str, float]]:
        """Sample responses to a batch of prompts and score them. With ``algorithm.dynamic_sampling``,
        further prompt batches are sampled while fewer than train_batch_size groups scored unevenly (at
        most max_sample_rounds batches), and the step keeps train_batch_size groups, informative first."""
        alg, t = self.config.algorithm, self.timer
        rounds: list[DataProto] = []
        metrics: dict[str, float] = {}
        num_groups, informative = self.config.data.train_batch_size, 0
        while True:
            with t("gen"):
                batch = self._generate(next(batches))
            with t("reward"):
                round_metrics = self._score_round(batch)
            metrics = metrics or round_metrics  # the first batch's: comparable with or without resampling
            if not alg.dynamic_sampling:
                return batch, metrics
            rounds.append(batch)
            informative += _num_informative_groups(batch)
            if informative >= num_groups or len(rounds) == alg.max_sample_rounds:
                break
        batch = concat_rollouts(rounds, self.tokenizer.pad_token_id)
        keep = pick_groups(
            batch.batch["token_level_scores"].sum(-1), batch.non_tensor_batch["uid"], num_groups
        )
        metrics["sampling/rounds"] = len(rounds)
        metrics["sampling/informative_group_frac"] = min(informative, num_groups) / num_groups
        return batch.select_idxs(keep), metrics

    def _score_round(self, batch: DataProto) -> dict[str, float]:
        """Score a generated batch (and guide its failed groups if ``algorithm.guide_failed_groups``)."""
        metrics = self._score(batch) | agent_metrics(batch)
        return metrics | (self._guide(batch) if self.config.algorithm.guide_failed_groups else {})

    def _score(self, batch: DataProto) -> dict[str, float]:
        """Rule-based scores (in the controller) plus the reward model's, as ``token_level_scores``."""
        cfg, metrics = self.config.reward, {}
        scores = torch.zeros(batch.batch["responses"].shape, dtype=torch.float32)
        if cfg.rule_weight:
            result = self.reward_manager(batch)
            scores += cfg.rule_weight * result.token_level_scores
            metrics |= result.metrics(prefix="reward/rule_") | {
                "reward/accuracy": result.accuracy.mean().item()
            }
        if self.roles.reward_model is not None:
            rm = self.roles.reward_model.compute_rm_score(_pick(batch, SCORE_KEYS)).batch["rm_scores"]
            scores += cfg.model_weight * rm
            metrics["reward/model_score"] = rm.sum(-1).mean().item()
        batch.batch["token_level_scores"] = scores
        metrics["reward/score"] = scores.sum(-1).mean().item()
        if self.config.has_groups:
            # Groups whose samples all score alike (all right or all wrong) give GRPO nothing to learn from.
            metrics["reward/uniform_group_frac"] = uniform_group_fraction(
                scores.sum(-1), batch.non_tensor_batch["uid"]
            )
        return metrics

    def _guide(self, batch: DataProto) -> dict[str, float]:
        """algorithm.guide_failed_groups: in each group where no sample scored 1.0, the first sample
        becomes the demonstration, and the batch is scored again."""
        uid = batch.non_tensor_batch["uid"]
        rows, responses, masks = self._demonstrations(
            batch, failed_group_rows(batch.batch["token_level_scores"].sum(-1), uid).tolist()
        )
        guided = np.zeros(len(batch), dtype=bool)
        guided[rows] = True
        batch.non_tensor_batch["guided"] = guided
        if rows:
            replace_responses(batch, rows, responses, self.tokenizer.pad_token_id, masks)
            self._score(batch)
        return {"guidance/guided_group_frac": len(rows) / len(set(uid.tolist()))}

    def _demonstrations(
        self, batch: DataProto, rows: list[int]
    ) -> tuple[list[int], list[list[int]], list[list[int]]]:
        """The demonstrations of ``rows``' prompts written as responses: the rows whose demonstration
        fits the batch's response width, their token ids (then eos) and their response masks (a
        trajectory's tool results out). A demonstration longer than that could not have been sampled
        either; it is left out."""
        demos = batch.non_tensor_batch.get("demonstration")
        if demos is None:
            demos = batch.non_tensor_batch[self.reward_manager.ground_truth_key]
        width, eos = batch.batch["responses"].shape[1], self.tokenizer.eos_token_id
        kept, responses, masks = [], [], []
        for row in rows:
            if self.agent:
                ids, mask = tokenize_demonstration(self.tokenizer, str(demos[row]), self.agent.fmt)
            else:
                ids = self.tokenizer(str(demos[row]), add_special_tokens=False)["input_ids"]
                mask = [1] * len(ids)
            if len(ids) < width:  # with its eos
                kept.append(row)
                responses.append([*ids, eos])
                masks.append([*mask, 1])
        return kept, responses, masks

    def _advantages(self, batch: DataProto) -> dict[str, float]:
        """Token rewards (with the KL penalty if configured), then advantages and returns."""
        alg, data, metrics = self.config.algorithm, batch.batch, {}
        mask = data["response_mask"]
        rewards = data["token_level_scores"]
        if alg.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty(
                rewards, data["old_log_prob"], data["ref_log_prob"], mask, self.kl_ctrl, alg.kl_penalty
            )
            metrics |= kl_metrics
        if "ref_log_prob" in data.keys() and "old_log_prob" in data.keys():
            metrics["actor/ref_kl"] = masked_mean(data["old_log_prob"] - data["ref_log_prob"], mask).item()
        if "rollout_log_prob" in data.keys() and "old_log_prob" in data.keys():
            # How far the sampler's log-probs are from the trainer's (0 up to numerics for the HF rollout).
            gap = (data["rollout_log_prob"] - data["old_log_prob"]).abs()
            sampled = mask  # the guided responses were written, not sampled
            if "guided" in batch.non_tensor_batch:
                sampled = mask * torch.as_tensor(~batch.non_tensor_batch["guided"]).unsqueeze(-1)
            metrics["rollout/log_prob_gap_mean"] = masked_mean(gap, sampled).item()
        data["token_level_rewards"] = rewards
        inputs = {
            "token_level_rewards": rewards,
            "response_mask": mask,
            "index": batch.non_tensor_batch["uid"],
        }
        if "values" in data.keys():
            inputs["values"] = data["values"]
        advantages, returns = get_advantage_estimator(alg.adv_estimator)(inputs, alg)
        data["advantages"], data["returns"] = advantages, returns
        metrics["adv/mean"] = masked_mean(advantages, mask).item()
        metrics["adv/returns_mean"] = masked_mean(returns, mask).item()
        if "values" in data.keys():
            metrics["critic/values_mean"] = masked_mean(data["values"], mask).item()
        return metrics

    def _actor_batch(self, batch: DataProto) -> DataProto:
        """What the actor update needs; without the uniform groups if ``algorithm.drop_uniform_groups``;
        with a demonstration row per prompt if ``actor.sft_loss_coef``."""
        cfg = self.config
        rows = _pick(batch, self._actor_keys())
        workers = cfg.trainer.num_workers
        if cfg.algorithm.drop_uniform_groups:
            keep = informative_rows(
                batch.batch["token_level_rewards"].sum(-1),  # what the advantages come from (KL included)
                batch.non_tensor_batch["uid"],
                multiple_of=workers,  # equal shares: DP dispatch would pad with (double-counted) repeats
                min_rows=workers * cfg.num_actor_mini_batches,
            )
            rows = rows.select_idxs(keep)
        return self._with_demonstrations(rows, batch) if cfg.actor.sft_loss_coef else rows

    def _with_demonstrations(self, rows: DataProto, batch: DataProto) -> DataProto:
        """``rows`` plus one row per prompt of ``batch`` whose response is the prompt's demonstration,
        for actor.sft_loss_coef's supervised term: ``sft_mask`` marks the tokens it reads (none of
        the sampled rows'), and their ``response_mask`` and advantages are 0, so the policy loss, KL
        and entropy leave them out. As many as split evenly over the workers, each worker's share
        of ``rows`` followed by its share of them."""
        uid = batch.non_tensor_batch["uid"]
        firsts = sorted(np.unique(uid, return_index=True)[1].tolist())
        picked, responses, masks = self._demonstrations(batch, firsts)
        workers = self.config.trainer.num_workers
        count = len(picked) - len(picked) % workers
        rows.batch["sft_mask"] = torch.zeros_like(rows.batch["response_mask"])
        if not count:
            return rows
        demos = batch.select_idxs(picked[:count])  # a copy
        replace_responses(
            demos, list(range(count)), responses[:count], self.tokenizer.pad_token_id, masks[:count]
        )
        demos = _pick(demos, self._actor_keys())
        demos.batch["sft_mask"] = demos.batch["response_mask"]
        for key in set(self._actor_keys()) - set(FORWARD_KEYS):  # response_mask, advantages, log-probs
            demos.batch[key] = torch.zeros_like(demos.batch[key])
        return DataProto.concat([p for pair in zip(rows.chunk(workers), demos.chunk(workers)) for p in pair])

    def _actor_keys(self) -> tuple[str, ...]:
        cfg = self.config
        return (
            ACTOR_UPDATE_KEYS
            + (("old_log_prob",) if cfg.compute_old_log_prob else ())
            + (("ref_log_prob",) if cfg.actor.use_kl_loss else ())
            + (("rollout_log_prob",) if cfg.actor.off_policy_correction != "none" else ())
        )

    def validate(self) -> dict[str, float]:
        """Held-out prompts, one response each (greedy unless rollout.val_temperature > 0): accuracy and score."""
        start = time.perf_counter()
        outputs = [self._generate(batch) for batch in self.val_batches]
        out = DataProto.concat(outputs) if len(outputs) > 1 else outputs[0]
        result = self.reward_manager(out, return_responses=True)
        metrics = result.metrics(prefix="val/") | agent_metrics(out, prefix="val/agent/")
        metrics["val/response_length"] = out.batch["response_mask"].sum(-1).float().mean().item()
        metrics["timing/validate_s"] = time.perf_counter() - start
        if self.tracker is not None:
            prompts = out.non_tensor_batch["raw_prompt"]
            answers = out.non_tensor_batch["ground_truth"]
            samples = "  ".join(
                f"{prompts[i]!s}{result.responses[i]!r} (want {answers[i]})" for i in range(min(3, len(out)))
            )
            self.tracker.print(
                f"validation at step {self.step}: accuracy {metrics['val/accuracy']:.3f}  e.g. {samples}"
            )
        return metrics

    # -- checkpoints ---------------------------------------------------------------------------

    def _log_and_checkpoint(self, metrics: dict[str, float]) -> None:
        """Log the step's metrics and, when one is due, checkpoint. The metrics line is on disk before the
        checkpoint is published: resume drops the lines after its checkpoint and keeps the rest, so a kill
        at any point leaves every step's line exactly once after resuming."""
        t = self.config.trainer
        if not _due(self.step, t.save_every, t.total_steps, always_last=True):
            self.tracker.log(metrics, step=self.step)
            return
        staged, save_metrics = self._stage_checkpoint()
        self.tracker.log(metrics | save_metrics, step=self.step)
        self.tracker.sync()
        publish_checkpoint(staged, self.config.trainer.max_checkpoints)

    def save_checkpoint(self) -> dict[str, float]:
        """Every role's state plus the controller's (step, data position, RNG, KL coefficient), atomically."""
        staged, metrics = self._stage_checkpoint()
        publish_checkpoint(staged, self.config.trainer.max_checkpoints)
        return metrics

    def _stage_checkpoint(self) -> tuple[Path, dict[str, float]]:
        """Write the checkpoint under a ``.tmp`` name, which resume never reads."""
        start = time.perf_counter()
        tmp = self.run_dir / CHECKPOINT_DIR / f"step_{self.step:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for name, group in self.roles.stateful().items():
            group.save_checkpoint(str(tmp / name))
        state = self._controller_state()
        with open(tmp / "trainer_state.pkl", "wb") as f:
            pickle.dump(state, f)
        return tmp, {"timing/save_s": time.perf_counter() - start}

    def resume(self) -> bool:
        """With ``trainer.resume``, load the latest checkpoint of the run dir; False if there was none."""
        latest = latest_checkpoint(self.run_dir)
        if not self.config.trainer.resume:
            return False
        if latest is None:  # killed before its first checkpoint: start afresh, without the old lines
            truncate_jsonl(self.run_dir / "metrics.jsonl", -1)
            return False
        self._load_checkpoint(latest)
        print(f"resumed from {latest} at step {self.step}", flush=True)
        return True

    def _load_checkpoint(self, latest: Path) -> None:
        """Every role's state and the controller's from ``latest``; drop the metrics lines after it."""
        for name, group in self.roles.stateful().items():
            group.load_checkpoint(str(latest / name))
        with open(latest / "trainer_state.pkl", "rb") as f:
            self._load_controller_state(pickle.load(f))
        self._sync_rollout(self.step)
        truncate_jsonl(self.run_dir / "metrics.jsonl", self.step)  # steps after the checkpoint are redone

    def _controller_state(self) -> dict:
        """The step, data position, KL coefficient and RNG states of this process."""
        return {
            "step": self.step,
            "loader": self.train_loader.state_dict(),
            "kl_coef": self.kl_ctrl.value,
            "rng": {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
            },
        }

    def _load_controller_state(self, state: dict) -> None:
        self.step = state["step"]
        self.train_loader.load_state_dict(state["loader"])
        self.kl_ctrl.value = state["kl_coef"]
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])

    # -- recovery ------------------------------------------------------------------------------

    def _recover(self, restarts: int, start: dict) -> None:
        """After a dead or hung rank: restart every rank of every group, which runs each role's
        constructor again (a fresh process per rank, torch.distributed formed again, as at start;
        a hung call is abandoned), then reload the latest checkpoint as ``trainer.resume`` does, or,
        before the first checkpoint, start again from step 0 (``start``: the controller's state then).

        Example (what the run prints, the first line from ``run_with_restarts``):
            step 5 failed: WorkerDiedError: worker rank 1 died during update_policy(): pid 4242 killed by SIGKILL
            restart 1 of 2: restarting groups ['actor_rollout'], then from checkpoints/step_000004
        """
        assert self.tracker is not None
        latest = latest_checkpoint(self.run_dir)
        print(
            f"restart {restarts} of {self.config.trainer.max_restarts}: restarting groups "
            f"{[g.name for g in self.roles.groups]}, then from {latest or 'step 0 (no checkpoint yet)'}",
            flush=True,
        )
        self.tracker.close()
        self.timer.pop()  # the failed step's partial timings
        for group in self.roles.groups:
            group.restart(list(range(group.world_size)))
        if latest is None:
            self._load_controller_state(start)
            truncate_jsonl(self.run_dir / "metrics.jsonl", -1)
        else:
            self._load_checkpoint(latest)
        self.tracker = self._make_tracker()

    # -- set-up --------------------------------------------------------------------------------

    def _build_data(self) -> tuple[PromptLoader, list[DataProto]]:
        cfg = self.config.data
        multi_turn = self.config.rollout.multi_turn
        train_set, val_batches = datasets_from_config(
            cfg,
            self.tokenizer,
            self.run_dir / "data",
            tools=tool_schemas(multi_turn.tools) if multi_turn.enable else None,
        )
        loader = PromptLoader(
            train_set,
            cfg.train_batch_size,
            shuffle=cfg.shuffle,
            seed=self.config.trainer.seed,
            pad_to_max_length=cfg.pad_to_max_length,
        )
        return loader, [replace(b, meta_info={"validate": True}) for b in val_batches]

    def _prompt_batches(self) -> Iterator[DataProto]:
        while True:  # one pass of the loader is one epoch; the next pass reshuffles
            yield from self.train_loader

    def _make_tracker(self) -> Tracker:
        t = self.config.trainer
        return Tracker(
            self.run_dir,
            t.loggers,
            project=t.project,
            experiment=t.experiment,
            config=to_dict(self.config),
            total_steps=t.total_steps,
            initial_step=self.step,
            progress=t.progress,
            log_every=t.log_every,
        )

    def shutdown(self) -> None:
        """Stop every worker process."""
        if self.agent is not None:
            self.agent.close()
        self.roles.shutdown()

    def __enter__(self) -> PPOTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _pick(batch: DataProto, keys: tuple[str, ...]) -> DataProto:
    """Only the tensors a call needs travel to the workers (meta_info goes along)."""
    return batch.select(batch_keys=keys, non_tensor_batch_keys=[])


def _num_informative_groups(batch: DataProto) -> int:
    """Groups of a scored batch whose samples did not all score alike."""
    uid = batch.non_tensor_batch["uid"]
    uniform = uniform_groups(batch.batch["token_level_scores"].sum(-1), uid).numpy()
    return len(set(uid[~uniform].tolist()))


def _due(step: int, every: int, total: int, always_last: bool = False) -> bool:
    return (every > 0 and step % every == 0) or (step == total and (every > 0 or always_last))


def _batch_metrics(batch: DataProto, max_new_tokens: int, timings: dict[str, float]) -> dict[str, float]:
    data = batch.batch
    lengths = data["response_mask"].sum(-1).float()
    tokens = data["attention_mask"].sum().item()  # prompt + response tokens processed this step
    # Tool observations (multi-turn) are response tokens outside the response mask.
    prompt_width = data["prompts"].shape[1]
    return {
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/clip_ratio": (data["attention_mask"][:, prompt_width:].sum(-1) >= max_new_tokens)
        .float()
        .mean()
        .item(),
        "prompt/length_mean": data["attention_mask"][:, :prompt_width].sum(-1).float().mean().item(),
        "perf/tokens": tokens,
        "perf/tokens_per_s": tokens / max(timings["timing/step_s"], 1e-9),
        # Sampled tokens per second of the rollout call (all workers together): the rollout engine's speed.
        "perf/gen_tokens_per_s": lengths.sum().item() / max(timings["timing/gen_s"], 1e-9),
    }
