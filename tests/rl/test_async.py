"""trainer.mode=async (#47): the producer and its staleness bound (no processes), then real runs on the
process backend: with max_staleness=0 the same numbers as the synchronous trainer; with the agent
loop and max_staleness=2, training overlaps generation, no sample is past the bound, and a run
stopped mid-way resumes with every prompt trained once.

Run: python -m pytest tests/rl/test_async.py -q
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from batches import SMALLEST_RUN, prompt_batch  # the module registers the every_turn tool format

from rl_extension.agents import TagFormat, get_tool, tool
from rl_extension.agents.loop import AgentLoop, TurnClient
from rl_extension.agents.rollout import trajectory_batch
from rl_extension.agents.turns import Sampling, TurnOutput
from rl_extension.app.plot import drawn_panels, plot_run, plot_timeline
from rl_extension.config import MultiTurnConfig, PPOConfig, load_config
from rl_extension.data.scorers import register_scorer
from rl_extension.models import build_tiny_tokenizer
from rl_extension.trainers.async_ppo import AsyncPPOTrainer, make_trainer
from rl_extension.trainers.async_rollout import RolloutProducer, Timeline, WeightVersions, staleness_metrics
from rl_extension.trainers.metrics import read_jsonl
from rl_extension.trainers.ppo import PPOTrainer
from spmdcall.data import DataProto


@register_scorer("digit_share")
def digit_share(response: str, ground_truth: str) -> float:
    """A random model's samples score unevenly under it, so its updates are not all zero."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


@tool(name="lagging_echo")
async def lagging_echo(x: str) -> str:
    await asyncio.sleep(0.05)
    return x[:3]


# -- the producer alone -------------------------------------------------------------------------


class _Loader:
    """Batches of 2 prompt ids in order, with a state as PromptLoader's."""

    def __init__(self):
        self.position = 0

    def __iter__(self):
        while True:
            self.position += 1
            yield DataProto.from_dict(
                {"prompt": torch.tensor([2 * self.position - 2, 2 * self.position - 1])}
            )

    def state_dict(self):
        return {"position": self.position}


class _Rollout:
    """generate: one token per prompt, tagged with the version it holds; load: a thread setting it."""

    def __init__(self):
        self.version = 0
        self.lock = threading.Lock()

    def generate(self, prompts: DataProto) -> DataProto:
        time.sleep(0.04 if prompts.batch["prompt"][0] % 4 == 0 else 0.01)  # even batches are slower
        rows = len(prompts)
        with self.lock:
            version = self.version
        return prompts.union(
            DataProto.from_dict(
                {
                    "response_mask": torch.ones(rows, 1, dtype=torch.long),
                    "policy_version": torch.full((rows, 1), version),
                }
            )
        )

    def load(self, version: int):
        done = threading.Event()

        def run():
            time.sleep(0.02)
            with self.lock:
                self.version = version
            done.set()

        threading.Thread(target=run).start()
        return _Future(done)


class _Future:
    def __init__(self, done):
        self._done = done

    def done(self):
        return self._done.is_set()

    def get(self):
        self._done.wait()


@pytest.mark.parametrize("max_staleness, in_flight", [(0, 1), (2, 1), (1, 2), (2, 2)])
def test_the_producer_keeps_prompt_order_the_bound_and_the_buffer(tmp_path, max_staleness, in_flight):
    """Batches in flight at once finish out of order (an even batch is slower than the next): the
    trainer still takes them in prompt order, none past the bound. At max_staleness=1 two batches may
    generate at once: batch k + 1 starts once batch k - 1 is trained, while batch k may still run."""
    rollout, loader, versions = _Rollout(), _Loader(), WeightVersions(0)
    timeline = Timeline(tmp_path / "timeline.jsonl")
    producer = RolloutProducer(
        [rollout.generate] * in_flight,
        loader,
        versions,
        start=0,
        stop_at=8,
        max_staleness=max_staleness,
        buffer_size=2,
        chunks=2,
        timeline=timeline,
    )
    lags = []
    try:
        for step in range(8):
            assert producer.loader_state(step) == {"position": step}  # the next untrained batch's
            index, batch, seconds = producer.take()
            assert index == step and seconds > 0
            assert batch.batch["prompt"].tolist() == [2 * step, 2 * step + 1]  # in order, whole
            lags.append(staleness_metrics(batch, step)["async/staleness_max"])
            assert producer.fill() <= 1.0
            time.sleep(0.03)  # the update
            versions.sent(step + 1, rollout.load(step + 1))
    finally:
        producer.stop()
        timeline.close()
    assert max(lags) <= max_staleness
    if max_staleness:
        assert max(lags) > 0  # it did run ahead
    spans = [json.loads(line) for line in open(tmp_path / "timeline.jsonl")]
    assert [s["kind"] for s in spans] == ["session"] + ["generate"] * 16  # 2 chunks a batch
    assert _batches_overlap(spans) == (in_flight > 1)
    again = Timeline(tmp_path / "again.jsonl")  # overlapping spans count once in a busy fraction
    for s in spans[1:]:
        again.add(s["kind"], s["start"], s["end"])
    assert 0 < again.busy("generate", spans[1]["start"], max(s["end"] for s in spans)) <= 1
    again.close()


def _batches_overlap(spans: list[dict]) -> bool:
    """Whether two batches' generate spans overlap in time."""
    return any(
        a["batch"] != b["batch"] and a["start"] < b["end"] and b["start"] < a["end"]
        for a in spans
        for b in spans
        if a["kind"] == b["kind"] == "generate"
    )


def test_busy_counts_a_span_under_way(tmp_path):
    """A batch still generating when a step ends counts in that step's rollout busy fraction."""
    timeline = Timeline(tmp_path / "timeline.jsonl")
    begun = timeline.begin("generate", 10.0)
    assert timeline.busy("generate", 8.0, 12.0) == pytest.approx(0.5)
    timeline.add("generate", 10.0, 13.0, begun=begun)
    assert timeline.busy("generate", 12.0, 14.0) == pytest.approx(0.5)
    timeline.close()


def test_staleness_counts_each_sample_from_its_oldest_token():
    batch = DataProto.from_dict(
        {
            "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
            "policy_version": torch.tensor([[3, 4, -1], [4, 4, 4]]),
        }
    )
    metrics = staleness_metrics(batch, 5)
    assert metrics["async/staleness_mean"] == 1.5 and metrics["async/staleness_max"] == 2
    assert metrics["async/staleness_token_mean"] == pytest.approx((2 + 1 + 1 + 1 + 1) / 5)


def test_a_trajectory_takes_new_weights_from_its_next_turn():
    """A scripted engine whose weights change between two calls (as load_weights lands between two
    generate_turns calls on a rank): each turn's tokens carry the version that sampled them, the tool
    observation the version of the turn that called, padding -1."""
    tokenizer = build_tiny_tokenizer()
    eos = tokenizer.eos_token
    turns = ["<call>lagging_echo abc</call>" + eos, "done" + eos]
    calls = []

    async def submit(requests):
        calls.append(len(requests))
        version = len(calls) - 1  # a new version between every two calls
        outputs = []
        for r in requests:
            ids = tokenizer(turns[len(calls) - 1], add_special_tokens=False)["input_ids"][: r.max_tokens]
            outputs.append(TurnOutput(ids, [], ids[-1] == tokenizer.eos_token_id, version))
        return [outputs]

    config = MultiTurnConfig(enable=True, tools=["lagging_echo"], max_turns=3)
    loop = AgentLoop(
        TurnClient(submit, world_size=1, max_in_flight=1),
        tokenizer,
        TagFormat(),
        {"lagging_echo": get_tool("lagging_echo")},
        config,
    )
    prompt = tokenizer("q=", add_special_tokens=False)["input_ids"]
    (t,) = asyncio.run(loop.run([prompt], max_new_tokens=60, sampling=Sampling(), seeds=[0]))
    assert t.num_turns == 2 and calls == [1, 1]
    first = len(tokenizer(turns[0], add_special_tokens=False)["input_ids"])
    observation = t.mask.index(1, first) - first
    assert t.versions == [0] * first + [0] * observation + [1] * (len(t.mask) - first - observation)
    rows = prompt_batch(tokenizer, ["q="])
    batch = trajectory_batch(rows, [t], 60, tokenizer.pad_token_id)
    assert batch.batch["policy_version"][0].tolist() == t.versions + [-1] * (60 - len(t.versions))
    metrics = staleness_metrics(batch, 2)
    assert metrics["async/staleness_max"] == 2 and metrics["async/staleness_token_mean"] < 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.backend=inline", "trainer.num_workers=1"], "backend=process or ray"),
        (["trainer.max_restarts=1"], "max_restarts=1 is not supported"),
        (["algorithm.dynamic_sampling=true"], "dynamic_sampling=true is not supported"),
        (
            ["trainer.rollout_batches_in_flight=3", "trainer.buffer_size=3"],
            "rollout_batches_in_flight=3 is more than trainer.max_staleness=1",
        ),
        (["trainer.max_staleness=0", "trainer.rollout_batches_in_flight=2"], "max_staleness=0 allows"),
        (
            ["trainer.max_staleness=3", "trainer.rollout_batches_in_flight=3"],
            "rollout_batches_in_flight=3 needs trainer.buffer_size >= 3",
        ),
    ],
)
def test_bad_async_config_is_refused_with_its_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(PPOConfig, "tiny-cpu", ["trainer.mode=async", *overrides]).validate()


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="eager"):
        load_config(PPOConfig, "tiny-cpu", ["trainer.mode=eager"]).validate()


def test_sync_mode_warns_about_async_keys():
    with pytest.warns(UserWarning, match="trainer.mode=sync ignores trainer.max_staleness"):
        load_config(PPOConfig, "tiny-cpu", ["trainer.max_staleness=3"])


def test_each_trainer_refuses_the_other_mode():
    # The demo built a PPOTrainer whatever trainer.mode said, and an async config failed at its first
    # weight sync (the rollout on a pool of its own has no colocated actor): refused up front now.
    with pytest.raises(
        ValueError, match=r"trainer.mode=async needs AsyncPPOTrainer, not PPOTrainer.*make_trainer"
    ):
        PPOTrainer(load_config(PPOConfig, "tiny-cpu", ["trainer.mode=async"]))
    with pytest.raises(ValueError, match=r"trainer.mode=sync needs PPOTrainer, not AsyncPPOTrainer"):
        AsyncPPOTrainer(load_config(PPOConfig, "tiny-cpu"))


# -- real runs --------------------------------------------------------------------------------

ONE_WORKER_RUN = [
    *SMALLEST_RUN,
    "trainer.num_workers=1",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=4",
    "rollout.max_new_tokens=8",
    "reward.scorer=digit_share",
    "trainer.val_every=0",
    "trainer.loggers=[jsonl]",
    "trainer.progress=none",
    "trainer.save_hf_model=false",
]
COMPARED = ["reward/score", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response/length_mean"]


@pytest.mark.timeout(240)
def test_async_without_staleness_trains_the_same_numbers_as_sync(tmp_path):
    runs = {}
    for mode in ("sync", "async"):
        overrides = [f"trainer.run_dir={tmp_path / mode}", *ONE_WORKER_RUN, "trainer.total_steps=3"]
        overrides += ["trainer.val_before_train=true", f"trainer.mode={mode}", "trainer.max_staleness=0"]
        config = load_config(PPOConfig, "tiny-cpu", overrides[:-1] if mode == "sync" else overrides)
        with make_trainer(config) as trainer:
            assert isinstance(trainer, AsyncPPOTrainer) == (mode == "async")
            trainer.fit()
        runs[mode] = read_jsonl(trainer.run_dir / "metrics.jsonl")
    sync, async_ = runs["sync"], runs["async"]
    assert [r["step"] for r in async_] == [r["step"] for r in sync] == [0, 1, 2, 3]
    assert async_[0]["val/accuracy"] == sync[0]["val/accuracy"]
    for s, a in zip(sync[1:], async_[1:]):
        assert a["actor/grad_norm"] > 0  # the updates do something
        for key in COMPARED:
            assert a[key] == pytest.approx(s[key], rel=1e-6, abs=1e-7), (s["step"], key)
        assert a["async/staleness_max"] == 0 and a["async/buffer_fill"] <= 1
        assert 0 <= a["async/rollout_busy_frac"] <= 1 and 0 < a["async/trainer_busy_frac"] <= 1


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_async_with_the_vllm_rollout_on_its_own_pool_trains_on_synced_weights(tmp_path):
    """The rollout as a vLLM engine in a group of its own: it generates while the actor trains,
    takes each new version from the actor group, and the decoupled loss reads its log-probs."""
    overrides = [f"trainer.run_dir={tmp_path}", *ONE_WORKER_RUN, "trainer.total_steps=4"]
    overrides += ["trainer.mode=async", "trainer.max_staleness=1", "rollout.name=vllm"]
    overrides += ["rollout.compute_log_probs=true", "actor.off_policy_correction=decoupled"]
    with make_trainer(load_config(PPOConfig, "tiny-cpu", overrides)) as trainer:
        trainer.fit()
    rows = [r for r in read_jsonl(trainer.run_dir / "metrics.jsonl") if "async/staleness_max" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # every sample at most one version behind the actor: the engine took each synced version (a
    # sample's version is the one its engine held), or by step 4 its samples would be 3 behind
    assert all(r["async/staleness_max"] <= 1 and r["actor/grad_norm"] > 0 for r in rows)
    # each step's sync went through the weight store: published, and loaded by the engine as a delta
    assert all(r["sync/published_bytes"] > 0 and r["sync/publish_s"] > 0 for r in rows)
    loads = [r for r in rows if "sync/bytes" in r]
    assert loads and all(0 < r["sync/changed_fraction"] <= 1 and r["sync/seconds"] > 0 for r in loads)
    assert all(r["sync/canary_gap"] <= 0.05 for r in loads)  # the engine's log-probs are the actor's
    assert not list(Path("/dev/shm").glob(f"spmdcall-weights-{os.getpid()}-*"))  # removed at shutdown


class _Killed(BaseException):
    """Stands for a SIGKILL: nothing in the trainer catches it."""


class _RecordingTrainer(AsyncPPOTrainer):
    """Records the prompts each step trains on; raises _Killed after step ``kill_after`` is logged."""

    kill_after = 0

    def __init__(self, config):
        super().__init__(config)
        self.trained: dict[int, list[str]] = {}

    def _generate_and_score(self, batches):
        batch, metrics = super()._generate_and_score(batches)
        uid = batch.non_tensor_batch["uid"]
        self.trained[self.step + 1] = list(dict.fromkeys(uid.tolist()))  # a prompt's samples share it
        assert (batch.batch["policy_version"][batch.batch["response_mask"].bool()] >= 0).all()
        return batch, metrics

    def _log_and_checkpoint(self, metrics):
        super()._log_and_checkpoint(metrics)
        if self.step == self.kill_after:
            raise _Killed()


@pytest.mark.timeout(300)
def test_agent_loop_runs_ahead_within_the_bound_and_resumes_without_skipping(tmp_path):
    """RLOO with multi-turn trajectories (a slow tool), max_staleness=2, two batches generating at once:
    the rollout generates while the trainer trains; the run is stopped after step 3 (checkpoint at step 2,
    later batches in the buffer or in flight) and resumed: steps 1-2 of the first run and 3-5 of the
    second train every prompt batch once, in the loader's order."""
    overrides = [
        f"trainer.run_dir={tmp_path / 'run'}",
        *ONE_WORKER_RUN,
        "trainer.mode=async",
        "trainer.max_staleness=2",
        "trainer.buffer_size=2",
        "trainer.rollout_batches_in_flight=2",
        "algorithm.adv_estimator=rloo",
        "trainer.total_steps=5",
        "trainer.save_every=2",
        "trainer.val_before_train=false",
        "rollout.max_new_tokens=24",
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.format=every_turn",
        "rollout.multi_turn.tools=[lagging_echo]",
        "rollout.multi_turn.max_tokens_per_turn=6",
    ]
    _RecordingTrainer.kill_after = 3
    first = _RecordingTrainer(load_config(PPOConfig, "tiny-cpu", overrides))
    with first, pytest.raises(_Killed):
        first.fit()
    _RecordingTrainer.kill_after = -1
    with _RecordingTrainer(load_config(PPOConfig, "tiny-cpu", [*overrides, "trainer.resume=true"])) as second:
        second.fit()
    assert sorted(second.trained) == [3, 4, 5]  # resumed from the step-2 checkpoint
    trained = [first.trained[1], first.trained[2], *(second.trained[s] for s in (3, 4, 5))]
    second.train_loader.load_state_dict({"epoch": 0, "position": 0})
    expected = [
        list(dict.fromkeys(b.non_tensor_batch["uid"].tolist())) for b, _ in zip(second.train_loader, range(5))
    ]
    assert trained == expected
    records = read_jsonl(second.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert max(r["async/staleness_max"] for r in records) <= 2
    assert all(r["agent/tool_calls_per_traj"] > 0 for r in records)
    # The rollout generated a batch while the trainer trained on an earlier one.
    spans = [json.loads(line) for line in open(second.run_dir / "timeline.jsonl")]
    trains = [s for s in spans if s["kind"] == "train"]
    generates = [s for s in spans if s["kind"] == "generate"]
    assert any(g["start"] < t["end"] and t["start"] < g["end"] for g in generates for t in trains)
    assert _batches_overlap(spans)  # two batches generated at once
    assert all(0 <= r["async/rollout_busy_frac"] <= 1 for r in records)
    assert plot_timeline(second.run_dir).endswith("timeline.png")
    assert plot_run(second.run_dir).endswith("metrics.png")
    assert {"staleness (async; versions behind)", "async: buffer and busy fractions"} <= set(
        drawn_panels(records)
    )
    assert np.isfinite([r["async/rollout_busy_frac"] for r in records]).all()


@pytest.mark.timeout(300)
def test_ppo_with_a_critic_and_the_agent_loop_on_ray(ray_session, tmp_path):
    """GAE with a critic on its own pool, the rollout on another, the actor on a third, on Ray:
    three groups, max_staleness=1, multi-turn trajectories with a tool (the agent loop takes new
    weights between turns), truncated importance weights (TIS)."""
    overrides = [
        f"trainer.run_dir={tmp_path / 'run'}",
        *ONE_WORKER_RUN,
        "trainer.backend=ray",
        "trainer.mode=async",
        "trainer.max_staleness=1",
        "rollout.max_new_tokens=24",
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.format=every_turn",
        "rollout.multi_turn.tools=[lagging_echo]",
        "rollout.multi_turn.max_tokens_per_turn=6",
        "trainer.total_steps=3",
        "trainer.val_before_train=false",
        "algorithm.adv_estimator=gae",
        "algorithm.drop_uniform_groups=false",
        "critic.placement=separate",
        "critic.ppo_mini_batch_size=2",
        "actor.off_policy_correction=tis",  # weights each token by pi_trained / pi_sampler, capped
        "rollout.compute_log_probs=true",
        "algorithm.guide_failed_groups=false",
    ]
    with make_trainer(load_config(PPOConfig, "tiny-cpu", overrides)) as trainer:
        trainer.fit()
        assert sorted(g.name.split("-")[0] for g in trainer.roles.groups) == ["actor", "critic", "rollout"]
    records = read_jsonl(trainer.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["async/staleness_max"] <= 1 and np.isfinite(r["critic/vf_loss"])
        assert 0 < r["actor/is_weight_mean"] <= 2
        assert r["agent/tool_calls_per_traj"] > 0


def _processes(title: str, groups: list) -> dict[str, int]:
    """The processes of ``groups``' ranks whose title starts with ``title``: title -> pid (found by
    name, as ``ps`` shows them, among this run's ranks only: another test may run the same classes)."""
    import psutil

    ours = {info["pid"] for g in groups for info in g.worker_info()}
    found = {}
    for pid in ours:
        with contextlib.suppress(psutil.NoSuchProcess):
            name = " ".join(psutil.Process(pid).cmdline())
            if name.startswith(title):
                found[name] = pid
    return found


class _KillingTrainer(_RecordingTrainer):
    """SIGKILLs rollout rank 1 (found by its process title) once step ``kill_at`` is logged, and
    records the actor's processes then."""

    kill_after = -1  # _RecordingTrainer's own kill: never
    kill_at = 0
    killed: int | None = None
    actors: dict[str, int] = {}

    def _log_and_checkpoint(self, metrics):
        super()._log_and_checkpoint(metrics)
        if self.step == self.kill_at:
            self.actors = _processes("spmdcall Actor", self.roles.groups)
            (self.killed,) = _processes("spmdcall HFRollout 1/2", self.roles.groups).values()
            os.kill(self.killed, 9)


@pytest.mark.timeout(300)
def test_a_killed_rollout_rank_is_replaced_while_the_actor_trains_on(tmp_path, capsys):
    """#68: rollout rank 1 is SIGKILLed after step 3 of 8; the run ends every step once, each batch of
    prompts in order, with the same actor processes, and logs the loss and the replacement."""
    overrides = [f"trainer.run_dir={tmp_path}", *ONE_WORKER_RUN, "trainer.total_steps=8"]
    overrides += ["trainer.mode=async", "trainer.max_staleness=1", "trainer.rollout_workers=2"]
    trainer = _KillingTrainer(load_config(PPOConfig, "tiny-cpu", overrides))
    trainer.kill_at = 3
    with trainer:
        trainer.fit()
        after = _processes("spmdcall Actor", trainer.roles.groups)
        rollout = _processes("spmdcall HFRollout", trainer.roles.groups)
    assert trainer.killed is not None and trainer.killed not in rollout.values()
    assert len(rollout) == 2 and after == trainer.actors and after  # the actor was not restarted
    rows = [r for r in read_jsonl(trainer.run_dir / "metrics.jsonl") if "async/staleness_max" in r]
    assert [r["step"] for r in rows] == list(range(1, 9))  # each step once
    assert sum(r["rollout/ranks_lost"] for r in rows) == 1 == sum(r["rollout/ranks_joined"] for r in rows)
    assert all(r["rollout/world_size"] == 2 for r in rows)
    # no prompt skipped or trained twice: each step trained the next batch of the loader, in order
    trainer.train_loader.load_state_dict({"epoch": 0, "position": 0})
    expected = [
        list(dict.fromkeys(b.non_tensor_batch["uid"].tolist()))
        for b, _ in zip(trainer.train_loader, range(8))
    ]
    assert [trainer.trained[s] for s in range(1, 9)] == expected
    assert "replaced in" in capsys.readouterr().out
    spans = read_jsonl(trainer.run_dir / "timeline.jsonl")
    assert len([s for s in spans if s["kind"] == "replace"]) == 1
    assert plot_timeline(trainer.run_dir).endswith("timeline.png")  # the replacement in red
    assert "rollout ranks (async)" in drawn_panels(rows)


class _ScalingTrainer(AsyncPPOTrainer):
    """Asks for 2 rollout workers after step 2 and for 1 after step 4 (``scale_rollout``)."""

    def _log_and_checkpoint(self, metrics):
        super()._log_and_checkpoint(metrics)
        if self.step in (2, 4):
            self.scale_rollout({2: 2, 4: 1}[self.step])


@pytest.mark.timeout(300)
def test_the_rollout_grows_and_shrinks_on_request_while_the_run_goes_on(tmp_path, capsys):
    """#68: 1 -> 2 rollout workers after step 2, back to 1 after step 4, of 6 steps; each step once."""
    overrides = [f"trainer.run_dir={tmp_path}", *ONE_WORKER_RUN, "trainer.total_steps=6"]
    overrides += ["trainer.mode=async", "trainer.max_staleness=1", "trainer.rollout_workers=1"]
    overrides += ["trainer.rollout_workers_max=2"]
    with _ScalingTrainer(load_config(PPOConfig, "tiny-cpu", overrides)) as trainer:
        trainer.fit()
        with pytest.raises(
            ValueError,
            match=r"rollout_workers=3 is outside trainer.rollout_workers_min=1 .. trainer.rollout_workers_max=2",
        ):
            trainer.scale_rollout(3)
    rows = [r for r in read_jsonl(trainer.run_dir / "metrics.jsonl") if "async/staleness_max" in r]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["rollout/world_size"] for r in rows] == [1, 1, 2, 2, 1, 1]
    assert [r["rollout/ranks_joined"] for r in rows] == [0, 0, 1, 0, 0, 0]
    assert [r["rollout/ranks_left"] for r in rows] == [0, 0, 0, 0, 1, 0]
    out = capsys.readouterr().out
    assert "rollout: 1 -> 2 workers" in out and "rollout: 2 -> 1 workers" in out


def test_spmdcall_rl_scale_asks_a_run_and_refuses_what_it_cannot_take(tmp_path, capsys):
    from rl_extension.app.cli import main
    from rl_extension.config import to_yaml
    from rl_extension.trainers.async_rollout import ScaleRequests

    config = load_config(
        PPOConfig,
        "tiny-cpu",
        ["trainer.mode=async", "trainer.rollout_workers=2", "trainer.rollout_workers_max=3"],
    )
    (tmp_path / "config.yaml").write_text(to_yaml(config))
    assert main(["scale", str(tmp_path), "--rollout-workers", "3"]) == 0
    assert ScaleRequests(tmp_path).take() == 3 and ScaleRequests(tmp_path).take() is None
    assert main(["scale", str(tmp_path), "--rollout-workers", "4"]) == 2
    assert (
        "outside the run's trainer.rollout_workers_min=1 .. trainer.rollout_workers_max=3"
        in capsys.readouterr().err
    )
    assert main(["scale", str(tmp_path / "nowhere"), "--rollout-workers", "2"]) == 2
    assert "is not a run directory" in capsys.readouterr().err
