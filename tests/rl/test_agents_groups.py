"""The agent loop against real worker groups, on the process and ray backends: AgentRollout over an
HFRollout group (tool failures, masks, determinism), and PPOTrainer with rollout.multi_turn (a few
steps, then a resume from a checkpoint mid-run that repeats the uninterrupted run's step exactly).

A random tiny model writes no tool calls of its own, so these tests read every turn as a call
(the ``every_turn`` format below): what they check is the plumbing, not the model's skill.

Run: python -m pytest tests/rl/test_agents_groups.py -q
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from batches import build_small_model, prompt_batch, with_meta  # with_meta's module registers every_turn

import spmdcall as sc
from rl_extension.agents import AgentRollout, tool
from rl_extension.config import ModelConfig, MultiTurnConfig, PPOConfig, RolloutConfig, load_config
from rl_extension.models import load_tokenizer
from rl_extension.roles import HFRollout
from rl_extension.trainers.metrics import read_jsonl
from rl_extension.trainers.ppo import PPOTrainer
from rl_extension.trainers.run_dir import CHECKPOINT_DIR, LATEST_FILE


@tool(name="a_echo")
async def echo(x: str) -> str:
    await asyncio.sleep(0.01)
    return x[:4]


@tool(name="b_fails")
def fails(x: str) -> str:
    raise RuntimeError("boom")


@tool(name="c_hangs")
async def hangs(x: str) -> str:
    await asyncio.sleep(3600)
    return x


@pytest.fixture(scope="module")
def backend(module_process_backend):
    return module_process_backend


@pytest.fixture(scope="module")
def small_path(tmp_path_factory):
    return build_small_model(tmp_path_factory.mktemp("agents_groups") / "tiny")


@pytest.mark.timeout(240)
def test_agent_rollout_on_a_group(backend, small_path):
    """Tool failures and timeouts become observations, masks hold, a fixed seed repeats itself."""
    rollout = RolloutConfig(
        n=2,
        max_new_tokens=300,
        compute_log_probs=True,
        multi_turn=MultiTurnConfig(
            enable=True,
            tools=["a_echo", "b_fails", "c_hangs"],
            format="every_turn",
            max_turns=4,
            max_tokens_per_turn=6,
            tool_timeout_s=0.5,
        ),
    )
    worker = sc.ClassWithInitArgs(
        HFRollout, ModelConfig(path=small_path), rollout, model_path=small_path, tokenizer_path=small_path
    )
    tokenizer = load_tokenizer(small_path)
    prompts = prompt_batch(tokenizer, ["12+34=", "hello", "abc"])
    with sc.WorkerGroup(sc.ResourcePool([2]), worker, backend=backend) as group:
        agent = AgentRollout(group, tokenizer, rollout, max_in_flight=HFRollout.TURN_CALLS_IN_FLIGHT, seed=3)
        start = time.monotonic()
        out = agent.generate(prompts)
        elapsed = time.monotonic() - start
        again = agent.generate(prompts)
        greedy = agent.generate(with_meta(prompts, validate=True))
        agent.close()
    assert len(out) == 6 and out.meta_info["n"] == 2
    assert torch.equal(out.batch["responses"], again.batch["responses"])  # the same seed, the same samples
    assert not torch.equal(out.batch["responses"][0], out.batch["responses"][1])  # samples of a prompt differ
    columns = out.non_tensor_batch
    assert columns["num_turns"].tolist() == [4] * 6 and columns["num_tool_calls"].tolist() == [9] * 6
    assert set(columns["finish_reason"]) == {"max_turns"}
    assert columns["num_tool_errors"].tolist() == [6] * 6  # b_fails raised, c_hangs timed out, each turn
    # 6 trajectories x 3 turns with a call hanging 0.5 s: overlapped (1.5 s), not one after another (9 s).
    assert elapsed < 6.0
    width = prompts.batch["input_ids"].shape[1]
    mask, attention = out.batch["response_mask"], out.batch["attention_mask"][:, width:]
    observed = attention.bool() & ~mask.bool()
    text = tokenizer.decode(out.batch["responses"][0][observed[0]].tolist())
    assert "[error: RuntimeError: boom]" in text and "[error: c_hangs timed out after 0.5 s]" in text
    assert (out.batch["rollout_log_prob"][observed] == 0).all()
    assert (mask.sum(-1) <= 4 * 6).all()  # model tokens: at most 6 a turn
    assert greedy.meta_info["validate"] and len(greedy) == 3


def _trainer_config(tmp_path, backend, *extra):
    return load_config(
        PPOConfig,
        "calc-cpu",
        [
            f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.backend={backend}",
            "model.tiny.num_layers=2",
            "model.tiny.hidden_size=64",
            "model.tiny.num_heads=2",
            "model.tiny.intermediate_size=128",
            "data.synthetic.num_train=64",
            "data.synthetic.num_val=4",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=2",
            "rollout.n=4",
            "rollout.max_new_tokens=40",
            "rollout.multi_turn.format=every_turn",
            "rollout.multi_turn.tools=[calc, a_echo]",
            "rollout.multi_turn.max_tokens_per_turn=8",
            "trainer.total_steps=3",
            "trainer.save_every=2",
            "trainer.val_every=3",
            "trainer.loggers=[jsonl]",
            "trainer.progress=none",
            "trainer.save_hf_model=false",
            *extra,
        ],
    )


@pytest.mark.timeout(420)
def test_trainer_multi_turn_then_resume_mid_run(backend, tmp_path):
    """Three GRPO steps with multi-turn rollouts; a resume from the step-2 checkpoint redoes step 3
    exactly (same trajectories, same update), so the run is deterministic and resumable."""
    with PPOTrainer(_trainer_config(tmp_path, backend)) as trainer:
        trainer.fit()
    first = read_jsonl(trainer.run_dir / "metrics.jsonl")
    assert [r["step"] for r in first] == [0, 1, 2, 3]
    step3 = first[-1]
    assert step3["agent/tool_calls_per_traj"] > 0 and 0 < step3["agent/tool_error_rate"] <= 1
    assert step3["agent/observation_tokens_mean"] > 0
    assert "val/agent/tool_calls_per_traj" in step3
    # Tool tokens are response tokens outside the mask: the model's tokens are fewer than the response's.
    assert step3["response/length_mean"] < 40

    checkpoints = trainer.run_dir / CHECKPOINT_DIR
    (checkpoints / LATEST_FILE).write_text("step_000002")  # as if killed after step 2's checkpoint
    with PPOTrainer(_trainer_config(tmp_path, backend, "trainer.resume=true")) as trainer:
        trainer.fit()
    second = read_jsonl(trainer.run_dir / "metrics.jsonl")
    assert [r["step"] for r in second] == [0, 1, 2, 3]
    redone = second[-1]
    for key in (
        "reward/score",
        "actor/pg_loss",
        "actor/entropy",
        "agent/tool_calls_per_traj",
        "response/length_mean",
    ):
        assert redone[key] == pytest.approx(step3[key], rel=1e-5, abs=1e-6), key
