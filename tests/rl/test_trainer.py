"""End-to-end PPOTrainer runs with a tiny model: GRPO, PPO with a critic, the inline backend, SFT.

Each run is 2 steps of a 2-layer, 64-wide model on 2 CPU processes (process backend), so the
whole file takes well under a minute or two.

Run: python -m pytest tests/rl/test_trainer.py -q
"""

import json

import pytest
import torch

from rl_extension.app.plot import plot_run
from rl_extension.config import PPOConfig, SFTConfig, load_config
from rl_extension.models import build_tiny_model, load_causal_lm
from rl_extension.trainers.metrics import read_jsonl
from rl_extension.trainers.ppo import PPOTrainer
from rl_extension.trainers.run_dir import latest_checkpoint
from rl_extension.trainers.sft import SFTTrainer

TINY = [
    "model.tiny.num_layers=2",
    "model.tiny.hidden_size=64",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=128",
]
SMALL_DATA = [
    "data.synthetic.num_train=200",
    "data.synthetic.num_val=12",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",
    "critic.ppo_mini_batch_size=2",
    "rollout.n=4",
    "trainer.total_steps=2",
    "trainer.val_every=2",
    "trainer.save_every=2",
    "trainer.loggers=[jsonl,tensorboard]",
    "trainer.progress=none",
]


def _run(tmp_path, preset, *overrides):
    config = load_config(
        PPOConfig, preset, [f"trainer.run_dir={tmp_path / 'run'}", *TINY, *SMALL_DATA, *overrides]
    )
    with PPOTrainer(config) as trainer:
        last = trainer.fit()
    return trainer, last, read_jsonl(trainer.run_dir / "metrics.jsonl")


def _finite(records, name):
    values = [r[name] for r in records if name in r]
    assert values, f"{name} was never logged"
    assert all(v is not None and v == v for v in values), f"{name}: {values}"
    return values


@pytest.mark.timeout(180)
def test_grpo_two_steps_with_kl_loss_on_process_backend(tmp_path):
    trainer, last, records = _run(
        tmp_path,
        "tiny-cpu",
        "actor.use_kl_loss=true",
        "rollout.compute_log_probs=true",
        "actor.ppo_epochs=2",
        "actor.lr_schedule=cosine",
        "actor.warmup_steps=1",
        "algorithm.drop_uniform_groups=true",
        "algorithm.guide_failed_groups=false",  # the preset's: a random model's groups would all be guided
        "actor.sft_loss_coef=0",  # the preset's: its rows would join the update's
    )
    assert [r["step"] for r in records] == [0, 1, 2]  # validation before training, then each step
    assert "val/accuracy" in records[0] and "val/accuracy" in records[-1]
    for name in (
        "reward/score",
        "reward/accuracy",
        "actor/entropy",
        "actor/pg_clipfrac",
        "actor/grad_norm",
        "actor/kl_loss",
        "actor/ref_kl",
        "response/length_mean",
        "perf/tokens_per_s",
        "perf/gen_tokens_per_s",
        "timing/gen_s",
        "timing/update_actor_s",
        "timing/ref_log_prob_s",
        "timing/step_s",
    ):
        _finite(records[1:], name)
    assert last["actor/lr"] > 0
    # 4 groups of 4 rows: the update gets the groups that scored unevenly, and at least one group
    # (2 workers x 2 mini-batches need 4 rows).
    for r in records[1:]:
        assert r["actor/update_row_frac"] == max(1 - r["reward/uniform_group_frac"], 0.25)
    # The reference is frozen at the start, so policy and reference agree before the first update.
    assert abs(records[1]["actor/ref_kl"]) < 1e-4
    # The rollout samples from a synced copy of the actor: its log-probs are the actor's.
    assert max(_finite(records[1:], "rollout/log_prob_gap_mean")) < 1e-3
    assert (trainer.run_dir / "config.yaml").exists()
    assert list((trainer.run_dir / "tensorboard").iterdir())
    checkpoint = latest_checkpoint(trainer.run_dir)
    assert checkpoint.name == "step_000002"
    assert {p.name for p in checkpoint.iterdir()} >= {"actor", "rollout", "trainer_state.pkl"}
    model = load_causal_lm(trainer.run_dir / "hf_model")  # the exported policy is a plain HF checkpoint
    assert model.config.num_hidden_layers == 2
    assert plot_run(trainer.run_dir).endswith("metrics.png")


@pytest.mark.timeout(180)
def test_ppo_with_critic_on_a_separate_pool_and_a_reward_model(tmp_path):
    reward_model = build_tiny_model(
        tmp_path / "rm", num_layers=1, hidden_size=64, num_heads=2, intermediate_size=128
    )
    _, _, records = _run(
        tmp_path,
        "tiny-cpu-ppo",
        "critic.placement=separate",
        "critic.num_workers=1",
        "critic.micro_batch_size_per_worker=4",
        f"reward.model_path={reward_model}",
        "reward.placement=separate",
        "reward.num_workers=1",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.kind=adaptive",
    )
    for name in (
        "critic/vf_loss",
        "critic/grad_norm",
        "critic/values_mean",
        "reward/model_score",
        "actor/reward_kl_penalty",
        "timing/update_critic_s",
        "timing/values_s",
    ):
        _finite(records[1:], name)
    # The value head starts at zero, so the first values are exactly 0.
    assert records[1]["critic/values_mean"] == 0.0


@pytest.mark.timeout(120)
def test_ppo_with_colocated_critic_on_inline_backend(tmp_path):
    _, _, records = _run(tmp_path, "tiny-cpu-ppo", "trainer.backend=inline", "trainer.num_workers=1")
    for name in ("critic/vf_loss", "actor/pg_loss", "reward/score"):
        _finite(records[1:], name)


@pytest.mark.timeout(120)
def test_refuses_to_overwrite_a_run_unless_asked(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match="already holds a run"):
        PPOTrainer(load_config(PPOConfig, "tiny-cpu", [f"trainer.run_dir={run_dir}", *TINY]))


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", marks=pytest.mark.timeout(120)),
        pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.timeout(300)]),
    ],
)
def test_sft_lowers_the_loss_and_writes_an_hf_checkpoint(tmp_path, device):
    on_device = ["use_gpu=true", "num_workers=1"] if device == "gpu" else []
    config = load_config(
        SFTConfig,
        "sft-tiny-cpu",
        [
            f"output_dir={tmp_path / 'sft'}",
            *TINY,
            *on_device,
            "total_steps=30",
            "batch_size=16",
            "data.synthetic.num_train=500",
            "data.synthetic.num_val=8",
            "log_every=0",
        ],
    )
    with SFTTrainer(config) as sft:
        summary = sft.fit()
    losses = [r["sft/loss"] for r in read_jsonl(tmp_path / "sft" / "metrics.jsonl")]
    assert len(losses) == 30 and losses[-1] < losses[0]
    assert 0.0 <= summary["val/accuracy"] <= 1.0
    model = load_causal_lm(summary["hf_model"])
    assert torch.isfinite(next(model.parameters())).all()


def test_sft_optimizer_takes_the_configured_betas(tmp_path):
    """``betas`` reaches the workers' AdamW (the demo's warm start sets beta2 below the default)."""
    config = load_config(
        SFTConfig,
        "sft-tiny-cpu",
        [
            f"output_dir={tmp_path / 'sft'}",
            *TINY,
            "backend=inline",
            "num_workers=1",
            "betas=[0.8, 0.95]",
            "total_steps=1",
            "batch_size=4",
            "data.synthetic.num_train=16",
            "data.synthetic.num_val=4",
            "log_every=0",
        ],
    )
    with SFTTrainer(config) as sft:
        (worker,) = sft.group._backend._instances  # inline: the rank is an object in this process
        assert [g["betas"] for g in worker.optimizer.param_groups] == [(0.8, 0.95)]


# -- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_grpo_with_bf16_compute_resumes_from_its_checkpoint(tmp_path):
    """On CUDA (nccl, a GPU per worker, bf16 mixed precision, the HF rollout synced from the actor):
    every metric finite, the memory metric logged, and a resumed run picks up at the saved step."""
    num_workers = min(torch.cuda.device_count(), 2)
    gpu = [
        "trainer.use_gpu=true",
        f"trainer.num_workers={num_workers}",
        "model.compute_dtype=auto",
        "actor.use_kl_loss=true",
        "rollout.compute_log_probs=true",
    ]
    _, _, records = _run(tmp_path, "tiny-cpu", *gpu)
    for name in ("reward/score", "actor/entropy", "actor/grad_norm", "actor/ref_kl", "timing/step_s"):
        _finite(records[1:], name)
    assert min(_finite(records[1:], "perf/max_memory_allocated_gib")) > 0
    # bf16 forwards in both engines: the rollout's log-probs match the actor's to bf16 precision.
    assert max(_finite(records[1:], "rollout/log_prob_gap_mean")) < 5e-2

    _, _, resumed = _run(tmp_path, "tiny-cpu", *gpu, "trainer.resume=true", "trainer.total_steps=3")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]  # steps 1-2 kept, step 3 trained on the resumed state
