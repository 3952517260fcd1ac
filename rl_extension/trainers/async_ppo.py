"""AsyncPPOTrainer: ``trainer.mode=async`` (#47), the rollout generating while the actor trains.

The rollout has a pool of its own; a producer thread (``async_rollout.RolloutProducer``) keeps it
generating batches into a bounded buffer, and each step of ``PPOTrainer._train_step`` takes the next
batch from there instead of generating it. Everything after generation (rewards, log-probs,
advantages, updates, validation, checkpoints) is the synchronous trainer's code. At the end of a
step the actor's weights go to the rollout group through a weight store (``Actor.publish_weights``
into shared memory, then ``load_weights(generation, version)``: only metadata passes the
controller, only changed tensors are copied, each checked against its checksum) without waiting: the load runs on each rollout rank after the
call in flight there, so a batch continues with the new weights from its next chunk
(``trainer.rollout_chunks``) or, in the agent loop, from its next turn; every response token
carries the ``policy_version`` that sampled it.

    config = load_config(PPOConfig, "tiny-cpu", ["trainer.mode=async", "trainer.max_staleness=1"])
    summary = AsyncPPOTrainer(config).fit()

With ``trainer.max_staleness=0`` the rollout waits for each step's weights before it starts the next
batch: the run trains the same numbers as ``trainer.mode=sync`` (tests/rl/test_async.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import spmdcall as sc
from rl_extension.config import PPOConfig
from rl_extension.roles import ROLLOUTS
from rl_extension.roles.weight_sync import publish_metrics
from rl_extension.trainers.async_rollout import (
    RolloutHealer,
    RolloutProducer,
    ScaleRequests,
    Timeline,
    WeightVersions,
    staleness_metrics,
)
from rl_extension.trainers.metrics import mean_metrics
from rl_extension.trainers.ppo import PPOTrainer
from spmdcall.data import DataProto, WeightReader

__all__ = ["AsyncPPOTrainer", "make_trainer"]


def make_trainer(config: PPOConfig) -> PPOTrainer:
    """The trainer ``trainer.mode`` asks for: ``PPOTrainer`` (sync) or ``AsyncPPOTrainer``."""
    return AsyncPPOTrainer(config) if config.trainer.mode == "async" else PPOTrainer(config)


class AsyncPPOTrainer(PPOTrainer):
    """``PPOTrainer`` with the rollout on its own pool, generating ahead by at most ``trainer.max_staleness``
    versions through a buffer of ``trainer.buffer_size`` batches, ``trainer.rollout_batches_in_flight``
    of them at once.

    The controller runs the trainer's thread (this object's methods), the producer's and one thread per
    batch in flight (each with an agent loop of its own); they share the rollout group (safe: groups
    take calls from any thread), the prompt loader (the producer alone iterates it; the trainer reads
    its state through ``RolloutProducer.loader_state``) and ``WeightVersions``. Validation runs on the
    trainer's thread once the rollout holds the step's weights.

    Args:
        config: a PPOConfig with ``trainer.mode=async``.
    """

    mode = "async"

    def __init__(self, config: PPOConfig):
        super().__init__(config)
        self.healer = RolloutHealer(self._replace_rollout, config.trainer.rollout_max_replacements)
        self.scale_requests = ScaleRequests(self.run_dir)
        self.versions = WeightVersions(0, self.healer)
        self.weight_store: sc.WeightStore | None = None  # made at the first sync, removed at shutdown
        self.producer: RolloutProducer | None = None
        self.timeline: Timeline | None = None
        self._window_start = 0.0  # the end of the previous step: busy fractions are over [it, now]
        self._wait_end = 0.0  # when the step's batch arrived: the trainer is busy from then on
        # The agent loop runs on an event loop of its own: each batch in flight gets a loop of its own.
        agents = [self.make_agent_rollout() for _ in range(config.trainer.rollout_batches_in_flight)]
        self.producer_agents = [agent for agent in agents if agent is not None]

    # -- the loop ------------------------------------------------------------------------------

    def _train(self) -> dict[str, float]:
        try:
            return super()._train()
        finally:
            self._stop_producer()

    def _start_producer(self) -> None:
        t = self.config.trainer
        self.timeline = Timeline(self.run_dir / "timeline.jsonl")
        self.versions = WeightVersions(self.step, self.healer)
        generators = [agent.generate for agent in self.producer_agents] or [
            self.roles.rollout.generate  # a group call: any number of threads may make it at once
        ] * t.rollout_batches_in_flight
        self.producer = RolloutProducer(
            generators,
            self.train_loader,
            self.versions,
            start=self.step,
            stop_at=t.total_steps,
            max_staleness=t.max_staleness,
            buffer_size=t.buffer_size,
            chunks=1 if self.producer_agents else t.rollout_chunks,  # the agent loop switches per turn
            timeline=self.timeline,
            healer=self.healer,
        )
        self._window_start = time.time()

    def _stop_producer(self) -> None:
        if self.producer is not None:
            self.producer.stop()  # batches generated but not trained are dropped (see loader_state)
            self.producer = None
        if self.timeline is not None:
            self.timeline.close()
            self.timeline = None

    def scale_rollout(self, rollout_workers: int) -> None:
        """Ask for ``rollout_workers`` rollout processes (within trainer.rollout_workers_min and _max),
        taken at the start of the next step; safe from any thread. ``spmdcall-rl scale RUN_DIR
        --rollout-workers N`` asks the same of a running run. New ranks load the newest weights
        before they generate; removed ranks finish the calls they were running first."""
        low, _, high = self.config.trainer.rollout_range()
        if not low <= rollout_workers <= high:
            raise ValueError(
                f"rollout_workers={rollout_workers} is outside trainer.rollout_workers_min={low} .. "
                f"trainer.rollout_workers_max={high}"
            )
        self.scale_requests.ask(rollout_workers)

    def _apply_scale_request(self) -> None:
        """Grow or shrink the rollout group to the number last asked for, if any."""
        asked = self.scale_requests.take()
        rollout = self.roles.rollout
        if asked is None or asked == rollout.world_size:
            return
        low, _, high = self.config.trainer.rollout_range()
        if not low <= asked <= high:
            print(f"rollout: {asked} workers asked for, outside {low}..{high}; ignored", flush=True)
            return
        start, before = time.time(), rollout.world_size
        with self.healer.exclusive():  # the batches' calls wait: new ranks take the newest weights first
            if asked > before:
                rollout.grow(asked - before)
                self._load_newest()
                self.healer.note(joined=asked - before)
            else:
                rollout.shrink(list(range(asked, before)))
                self.healer.note(left=before - asked)
        if self.timeline is not None:
            self.timeline.add("resize", start, time.time(), step=self.step + 1)
        print(f"rollout: {before} -> {asked} workers in {time.time() - start:.2f} s", flush=True)

    def _generate_and_score(self, batches: Iterator[DataProto]) -> tuple[DataProto, dict[str, float]]:
        """The next batch from the buffer (the producer reads the loader, not ``batches``), scored.
        ``timing/gen_s`` is the time the trainer waited for it; ``async/generate_s`` the rollout's."""
        if self.producer is None:
            self._start_producer()
        self._apply_scale_request()
        assert self.producer is not None and self.timeline is not None
        fill = self.producer.fill()
        start = time.time()
        with self.timer("gen"):
            index, batch, generate_s = self.producer.take()
        self._wait_end = time.time()
        self.timeline.add("wait", start, self._wait_end, step=self.step + 1)
        assert index == self.step, f"batch {index} arrived for step {self.step}"
        with self.timer("reward"):
            batch, metrics = self.score_round(batch)
        staleness = staleness_metrics(batch, self.step)
        assert staleness["async/staleness_max"] <= self.config.trainer.max_staleness, staleness
        tokens = batch.batch["response_mask"].sum().item()
        return batch, metrics | staleness | self.healer.pop_metrics() | {
            "rollout/world_size": float(self.roles.rollout.world_size),
            "async/buffer_fill": fill,
            "async/generate_s": generate_s,
            "async/gen_tokens_per_s": tokens / max(generate_s, 1e-9),
        }

    def _sync_rollout(self, version: int) -> dict[str, float]:
        """Publish the actor's weights as ``version`` into the run's weight store and send the rollout
        group the generation's metadata: each rollout rank copies what changed straight from shared
        memory (never through the controller). The trainer goes on at once (the load waits on each
        rollout rank for the call in flight); before the producer starts (resume) it waits. Returns
        the publication's metrics and those of the loads finished since the last sync."""
        if self.weight_store is None:
            self.weight_store = sc.WeightStore()
        atol = self.config.trainer.weight_canary_atol
        generation = self.roles.actor.publish_weights(version, self.weight_store.root, atol)
        metrics = publish_metrics(generation)
        if self.producer is None:
            loaded = self.healer.call(lambda: self.roles.rollout.load_weights(generation, version))
            self.versions = WeightVersions(version, self.healer)
            return metrics | mean_metrics(loaded)
        load = self.healer.call(lambda: self.roles.rollout.load_weights.submit(generation, version))
        self.versions.sent(version, load)
        return metrics | self.versions.load_metrics()

    def _load_newest(self) -> None:
        """Every rollout rank takes the newest published weights (new ranks all of them, the others
        nothing: they hold them already)."""
        if self.weight_store is not None and WeightReader(self.weight_store.root).newest() is not None:
            self.roles.rollout.load_newest_weights(self.weight_store.root)

    def _replace_rollout(self, exc: BaseException) -> None:
        """Restart the dead rollout ranks (all of them if they share a process group) while the actor
        trains on; each new rank loads the newest published weights itself."""
        start = time.time()
        rollout = self.roles.rollout
        together = ROLLOUTS[self.config.rollout.name].NEEDS_PROCESS_GROUP
        rollout.restart(list(range(rollout.world_size)) if together else None)  # None: the dead ones
        self._load_newest()
        end = time.time()
        if self.timeline is not None:
            self.timeline.add("replace", start, end, step=self.step + 1)
        print(f"rollout: {exc}; replaced in {end - start:.2f} s, the actor trains on", flush=True)

    def _log_and_checkpoint(self, metrics: dict[str, float]) -> None:
        """The step's busy fractions (over the time since the previous step ended) join its metrics."""
        now = time.time()
        if self.timeline is not None:
            self.timeline.add("train", self._wait_end, now, step=self.step)
            window = now - self._window_start
            metrics["async/rollout_busy_frac"] = self.timeline.busy("generate", self._window_start, now)
            metrics["async/trainer_busy_frac"] = 1.0 - metrics["timing/gen_s"] / max(window, 1e-9)
            metrics["perf/gen_tokens_per_s"] = metrics["async/gen_tokens_per_s"]
        super()._log_and_checkpoint(metrics)
        self._window_start = time.time()

    def validate(self) -> dict[str, float]:
        """As ``PPOTrainer.validate``, once the rollout holds this step's weights."""
        self.versions.wait_for(self.step)
        return super().validate()

    # -- checkpoints ---------------------------------------------------------------------------

    def _controller_state(self) -> dict:
        """The synchronous trainer's, with the loader's position before the first batch not trained yet:
        the batches in the buffer or in flight are generated again after a resume."""
        state = super()._controller_state()
        if self.producer is not None:
            state["loader"] = self.producer.loader_state(self.step)
        return state

    def shutdown(self) -> None:
        self._stop_producer()
        for agent in self.producer_agents:
            agent.close()
        super().shutdown()
        if self.weight_store is not None:
            self.weight_store.close()
            self.weight_store = None
