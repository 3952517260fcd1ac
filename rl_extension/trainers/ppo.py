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

import time
from collections.abc import Iterator
from dataclasses import replace

from rl_extension.agents import AgentRollout, agent_metrics, tool_schemas
from rl_extension.algorithms.advantages import compute_advantages
from rl_extension.algorithms.kl import get_kl_controller
from rl_extension.config import PPOConfig, to_dict
from rl_extension.data.inputs import check_inputs
from rl_extension.data.prompts import prompt_loaders
from rl_extension.data.rewards import RewardManager, get_scorer, score_batch
from rl_extension.models import load_tokenizer, resolve_model_path
from rl_extension.roles import ROLLOUTS
from rl_extension.roles.groups import build_roles
from rl_extension.roles.keys import ACTOR_UPDATE_KEYS, CRITIC_UPDATE_KEYS, FORWARD_KEYS, SCORE_KEYS
from rl_extension.trainers.batch_transforms import BatchContext, apply_transforms
from rl_extension.trainers.checkpointing import Checkpointer, controller_state, load_controller_state
from rl_extension.trainers.metrics import StageTimer, Tracker, mean_metrics
from rl_extension.trainers.run_dir import prepare_run_dir, run_with_restarts
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
                "build the trainer with rl_extension.trainers.async_ppo.make_trainer(config)"
            )
        check_inputs(config)  # a missing checkpoint or data file fails here, before the run dir is touched
        self.config = config
        self.run_dir = prepare_run_dir(config)
        self.model_path = resolve_model_path(config.model, self.run_dir)
        self.tokenizer_path = config.model.tokenizer_path or self.model_path
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        tools = tool_schemas(config.rollout.multi_turn.tools) if config.rollout.multi_turn.enable else None
        self.train_loader, self.val_batches = prompt_loaders(
            config.data, self.tokenizer, self.run_dir / "data", seed=config.trainer.seed, tools=tools
        )
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
        self.agent = self.make_agent_rollout()
        self.checkpoints = Checkpointer(self.run_dir, config.trainer.max_checkpoints)
        self.batch_context = BatchContext(  # what the batch recipes (batch_transforms) may use
            config=config,
            tokenizer=self.tokenizer,
            ground_truth_key=self.reward_manager.ground_truth_key,
            tool_format=self.agent.fmt if self.agent else None,
            score=self._score,
        )

    def make_agent_rollout(self) -> AgentRollout | None:
        """An agent loop on the rollout's engine where ``rollout.multi_turn`` is on, else None."""
        rollout = self.config.rollout
        if not rollout.multi_turn.enable:
            return None
        in_flight, seed = ROLLOUTS[rollout.name].TURN_CALLS_IN_FLIGHT, self.config.trainer.seed
        return AgentRollout(self.roles.rollout, self.tokenizer, rollout, max_in_flight=in_flight, seed=seed)

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
                metrics |= compute_advantages(batch, cfg.algorithm, self.kl_ctrl)
            if roles.critic is not None:
                with t("update_critic"):
                    metrics |= mean_metrics(roles.critic.update_critic(_pick(batch, CRITIC_UPDATE_KEYS)))
            with t("update_actor"):
                actor_batch = self._actor_batch(batch)
                metrics["actor/update_row_frac"] = len(actor_batch) / len(batch)
                metrics |= mean_metrics(roles.actor.update_policy(actor_batch))
            with t("sync_weights"):
                metrics |= self._sync_rollout(self.step + 1)
        self.step += 1
        metrics |= self.timer.pop()
        return metrics | _batch_metrics(batch, cfg.rollout.max_new_tokens, metrics)

    # -- the steps -----------------------------------------------------------------------------

    def _sync_rollout(self, version: int) -> dict[str, float]:
        """The rollout takes the actor's current weights (``version``: the actor updates they hold);
        the sync's ``sync/*`` metrics (none for a colocated rollout: it copies in its own process)."""
        self.roles.rollout.sync_weights()
        return {}

    def _generate(self, prompts: DataProto) -> DataProto:
        """The rollout's responses; with rollout.multi_turn, the agent loop's trajectories (same columns)."""
        return self.agent.generate(prompts) if self.agent else self.roles.rollout.generate(prompts)

    def _generate_and_score(self, batches: Iterator[DataProto]) -> tuple[DataProto, dict[str, float]]:
        """Sample responses to a batch of prompts and score them, then the "step" transforms
        (``batch_transforms``: dynamic sampling, which may sample more prompt batches)."""
        batch, metrics = self._sample(next(batches))
        context = replace(self.batch_context, sample=lambda: self._sample(next(batches)))
        batch, more = apply_transforms("step", batch, context)
        return batch, metrics | more

    def _sample(self, prompts: DataProto) -> tuple[DataProto, dict[str, float]]:
        """One round: the responses to ``prompts``, scored (timed as gen and reward)."""
        with self.timer("gen"):
            batch = self._generate(prompts)
        with self.timer("reward"):
            return self.score_round(batch)

    def score_round(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        """Score a generated batch, then the "round" transforms (guidance)."""
        metrics = self._score(batch) | agent_metrics(batch)
        batch, more = apply_transforms("round", batch, self.batch_context)
        return batch, metrics | more

    def _score(self, batch: DataProto) -> dict[str, float]:
        """Rule-based scores plus the reward model's, as ``token_level_scores`` (``rewards.score_batch``)."""
        cfg = self.config
        return score_batch(batch, cfg.reward, self.reward_manager, self.roles.reward_model, cfg.has_groups)

    def _actor_batch(self, batch: DataProto) -> DataProto:
        """What the actor update needs, after the "update" transforms (without the uniform groups if
        ``algorithm.drop_uniform_groups``; with a demonstration row per prompt if ``actor.sft_loss_coef``)."""
        rows, _ = apply_transforms("update", batch, replace(self.batch_context, scored=batch))
        return _pick(rows, self._actor_keys())

    def _actor_keys(self) -> tuple[str, ...]:
        cfg = self.config
        return (
            ACTOR_UPDATE_KEYS
            + (("old_log_prob",) if cfg.compute_old_log_prob else ())
            + (("ref_log_prob",) if cfg.actor.use_kl_loss else ())
            + (("rollout_log_prob",) if cfg.actor.off_policy_correction != "none" else ())
            + (("sft_mask",) if cfg.actor.sft_loss_coef else ())
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
        state = self._controller_state()
        staged, save_metrics = self.checkpoints.stage(self.step, self.roles.stateful(), state)
        self.tracker.log(metrics | save_metrics, step=self.step)
        self.tracker.sync()
        self.checkpoints.publish(staged)

    def save_checkpoint(self) -> dict[str, float]:
        """Every role's state plus the controller's (step, data position, RNG, KL coefficient), atomically."""
        return self.checkpoints.save(self.step, self.roles.stateful(), self._controller_state())

    def resume(self) -> bool:
        """With ``trainer.resume``, load the latest checkpoint of the run dir; False if there was none."""
        if not self.config.trainer.resume:
            return False
        loaded = self.checkpoints.load_latest(self.roles.stateful())
        if loaded is not None:
            self._restore(loaded[1])
            print(f"resumed from {loaded[0]} at step {self.step}", flush=True)
        return loaded is not None

    def _controller_state(self) -> dict:
        """The step, data position, KL coefficient and RNG states of this process."""
        return controller_state(self.step, self.train_loader.state_dict(), self.kl_ctrl.value)

    def _restore(self, state: dict, sync: bool = True) -> None:
        """Go back to a ``_controller_state``; the rollout takes the actor's (loaded) weights if ``sync``."""
        self.step = load_controller_state(state, self.train_loader, self.kl_ctrl)
        if sync:
            self._sync_rollout(self.step)

    def _recover(self, restarts: int, start: dict) -> None:
        """After a dead or hung rank: restart every group and reload the latest checkpoint
        (``Checkpointer.restart``), or, before the first checkpoint, start again from step 0
        (``start``: the controller's state then).

        Example (what the run prints, the first line from ``run_with_restarts``):
            step 5 failed: WorkerDiedError: worker rank 1 died during update_policy(): pid 4242 killed by SIGKILL
            restart 1 of 2: restarting groups ['actor_rollout'], then from checkpoints/step_000004
        """
        assert self.tracker is not None
        print(
            f"restart {restarts} of {self.config.trainer.max_restarts}: restarting groups "
            f"{[g.name for g in self.roles.groups]}, then from "
            f"{self.checkpoints.latest() or 'step 0 (no checkpoint yet)'}",
            flush=True,
        )
        self.tracker.close()
        self.timer.pop()  # the failed step's partial timings
        loaded = self.checkpoints.restart(self.roles.groups, self.roles.stateful())
        self._restore(loaded[1] if loaded else start, sync=loaded is not None)
        self.tracker = self._make_tracker()

    # -- set-up --------------------------------------------------------------------------------

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
