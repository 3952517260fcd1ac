"""The main job, shrunk: ``spmdcall-rl demo`` (tiny model -> addition data -> SFT -> GRPO -> accuracy
before/after -> plot) on the process backend through the real CLI, and on Ray through ``run_demo``.

Shrunk means a 2-layer, 64-wide model, 20 SFT steps and 2 GRPO steps: this checks that every stage
runs and reports, not that the model learns (docs/rl/experiment-log.md has the full runs).

Run: python -m pytest tests/rl/test_demo.py -q
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rl_extension.app.demo import algorithm_name, run_demo
from rl_extension.config import PPOConfig, load_config
from rl_extension.trainers.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
SFT = [
    "model.tiny.num_layers=2",
    "model.tiny.hidden_size=64",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=128",
    "total_steps=20",
    "eval_every=10",
    "stop_at_accuracy=0",
    "log_every=0",
]
GRPO = [
    "trainer.total_steps=2",
    "trainer.val_every=2",
    "trainer.save_every=0",
    "trainer.progress=none",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=4",
    "data.val_batch_size=64",
]


def _demo_cli(*args: str) -> subprocess.CompletedProcess:
    """``spmdcall-rl demo ARGS`` in a fresh interpreter; it must succeed."""
    result = subprocess.run(
        [sys.executable, "-m", "rl_extension", "demo", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def addition_demo(tmp_path_factory):
    """One folder for this file's addition demos of the same SFT config: the first runs the SFT warm
    start, the later ones keep it (``reuse_sft``, as benchmarks/rl/demo_seeds.py --reuse-sft does)."""
    return tmp_path_factory.mktemp("addition") / "demo"


@pytest.mark.timeout(300)
def test_demo_cli_runs_every_stage_on_the_process_backend(addition_demo):
    out = addition_demo
    result = _demo_cli("--out", str(out), *GRPO, *(f"sft.{o}" for o in SFT))
    for stage in ("[demo 1/4]", "[demo 2/4]", "[demo 3/4]", "[demo 4/4]"):
        assert stage in result.stdout
    report = result.stdout[result.stdout.index("[demo 4/4]") :]
    assert re.search(r"before GRPO:\s+\d+\.\d%", report) and re.search(r"after GRPO \(2 steps\)", report)
    plot = Path(re.search(r"plot: (\S+)", report).group(1))
    assert plot.is_file() and plot.stat().st_size > 0
    records = read_jsonl(out / "grpo" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    # The tiny-cpu preset learns from the reward alone: no guidance, no supervised term, and the report says so.
    assert not any("guidance/guided_group_frac" in r or "actor/sft_loss" in r for r in records)
    assert "learned from: the reward alone (the 'exact_match' verifier)" in report


@pytest.mark.timeout(300)
def test_demo_on_ray_with_the_wide_presets(tmp_path, ray_session):
    summary = run_demo(
        tmp_path / "demo",
        backend="ray",
        train_overrides=["preset=tiny-cpu-wide", *GRPO],
        sft_overrides=["preset=sft-tiny-cpu-wide", *SFT],
    )
    assert summary["sft_steps"] == 20
    config = (Path(summary["run_dir"]) / "config.yaml").read_text()
    assert "experiment: tiny-cpu-wide" in config and "compute_dtype: auto" in config
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert Path(summary["plot"]).is_file()


def test_demo_names_the_stage_by_the_estimator_s_display_name():
    names = {
        estimator: algorithm_name(load_config(PPOConfig, preset, [f"algorithm.adv_estimator={estimator}"]))
        for preset, estimator in [
            ("tiny-cpu", "grpo"),
            ("tiny-cpu", "rloo"),
            ("tiny-cpu-ppo", "gae"),
            ("tiny-cpu-ppo", "reinforce_plus_plus"),
        ]
    }
    assert names == {"grpo": "GRPO", "rloo": "RLOO", "gae": "PPO", "reinforce_plus_plus": "REINFORCE++"}


@pytest.mark.timeout(300)
def test_calc_demo_with_the_tool_reports_tool_use(tmp_path):
    """``demo --task calc``: SFT on tool demonstrations (evaluated with the tool), GRPO with multi-turn
    rollouts from the reward alone, and the report's tool-use line; guidance is there on request."""
    out = tmp_path / "calc"
    sft = [f"sft.{o}" for o in SFT if not o.startswith("total_steps")]
    result = _demo_cli("--task", "calc", "--out", str(out), *GRPO, *sft, "sft.total_steps=10")
    report = result.stdout[result.stdout.index("[demo 4/4]") :]
    assert re.search(r"tool use on them: \d+\.\d\d calls per problem, \d+\.\d% of calls failed", report)
    assert "4-digit multiplication with the calc tool" in result.stdout
    records = read_jsonl(out / "grpo" / "metrics.jsonl")
    assert "agent/tool_calls_per_traj" in records[-1] and "val/agent/tool_error_rate" in records[-1]
    assert "guidance/guided_group_frac" not in records[-1]  # the reward alone, unless asked
    assert "learned from: the reward alone" in report
    assert "<call>calc" in (out / "data" / "demos.parquet").read_bytes().decode("latin-1")


@pytest.mark.timeout(400)
def test_controls_of_the_guided_recipe_start_from_its_warm_start(addition_demo):
    """``rl_extension.app.controls``: the guided recipe beside the same recipe with the reward removed (its
    supervised term still trains, every score is ~0) and SFT continued for the recipe's GRPO minutes.
    The recipe keeps the CLI demo's warm start (the same SFT config) where that test ran first."""
    from rl_extension.app.controls import run_controls, sft_step_seconds

    out = addition_demo
    sft_model = out / "sft" / "hf_model" / "config.json"
    before = sft_model.stat().st_mtime_ns if sft_model.exists() else None
    grpo = ["preset=tiny-cpu-guided", *GRPO]
    recipe = run_demo(out, train_overrides=grpo, sft_overrides=SFT, reuse_sft=True)
    assert recipe["learned_from"].startswith("the reward (the 'exact_match' verifier) plus a supervised term")
    written = sft_model.stat().st_mtime_ns
    assert before in (None, written)  # a finished SFT of the same config is kept, not run again
    assert recipe["sft_steps"] == 20 and recipe["total_s"] >= recipe["sft_s"] > 0
    controls = run_controls(out, recipe, seed=0, train_overrides=grpo, sft_overrides=SFT)
    assert sft_model.stat().st_mtime_ns == written  # the same warm start, not a new SFT
    no_reward = read_jsonl(out / "grpo-no-reward" / "metrics.jsonl")
    trained = [r for r in no_reward if "reward/score" in r]
    assert trained and max(abs(r["reward/score"]) for r in trained) < 1e-9
    assert all(r["actor/sft_loss"] > 0 for r in trained)  # the supervised term alone trains
    assert 0.0 <= controls["no_reward_after"] <= 1.0 and controls["no_reward_s"] > 0
    sft_more = read_jsonl(out / "sft-more" / "metrics.jsonl")
    assert sft_more[-1]["val/accuracy"] == controls["sft_more_after"]
    # The recipe's GRPO minutes in SFT steps, at the warm start's own step time.
    step_s = sft_step_seconds(out / "sft" / "metrics.jsonl")
    assert 0 < step_s < 60 and sft_more[-1]["step"] == controls["sft_more_steps"]
    assert controls["sft_more_steps"] == max(1, round(recipe["grpo_s"] / step_s))


def test_sft_step_time_leaves_out_evaluations_and_controls_are_named(tmp_path):
    import json

    from rl_extension.app.controls import run_controls, sft_step_seconds

    rows = [{"step": 1, "timing/elapsed_s": 1.0}, {"step": 2, "timing/elapsed_s": 1.5}]
    rows += [{"step": 3, "timing/elapsed_s": 9.0, "val/accuracy": 0.5}, {"step": 4, "timing/elapsed_s": 9.5}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sft_step_seconds(metrics) == 0.5  # the evaluating step's 7.5 s are not a step's time
    metrics.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match="no consecutive training steps"):
        sft_step_seconds(metrics)
    with pytest.raises(ValueError, match="unknown controls \\['more_rl'\\]"):
        run_controls(tmp_path, {}, seed=0, which=("more_rl",))


@pytest.mark.parametrize(("task", "use_tool"), [("calc", True), ("calc", False), ("addition", False)])
def test_the_reward_removed_control_runs_the_recipes_own_task(tmp_path, monkeypatch, task, use_tool):
    """A calc recipe's control is a calc run from the calc warm start (it once ran the addition demo)."""
    import rl_extension.app.controls as controls

    calls: list[dict] = []

    def fake_run_demo(out, **kwargs):
        calls.append(kwargs)
        return {"accuracy_after": 0.25}

    monkeypatch.setattr(controls, "run_demo", fake_run_demo)
    recipe = {"task": task, "use_tool": use_tool}
    result = controls.run_controls(tmp_path, recipe, seed=3, which=("no_reward",))
    assert result["no_reward_after"] == 0.25
    (call,) = calls
    assert (call["task"], call["use_tool"], call["seed"], call["reuse_sft"]) == (task, use_tool, 3, True)
    assert controls.NO_REWARD[0] in call["train_overrides"]


def test_the_report_of_a_reward_removed_run_says_what_still_trains():
    from rl_extension.app.controls import NO_REWARD
    from rl_extension.app.demo import learned_from

    guided = learned_from(load_config(PPOConfig, "tiny-cpu-guided", NO_REWARD))
    assert guided.startswith(
        "no reward (the 'exact_match' verifier weighted 1e-12, the reward removed): only "
    )
    assert (
        "only a supervised term on the ground truth (actor.sft_loss_coef=1); guidance writes the ground truth "
        in guided
    )
    assert guided.endswith("into every group, where its advantage is ~0 as every sample's")
    alone = learned_from(load_config(PPOConfig, "tiny-cpu", NO_REWARD))
    assert alone.endswith("the reward removed): nothing should train")
    # guidance without a supervised term trains nothing either once the reward is gone
    guidance_only = learned_from(
        load_config(PPOConfig, "tiny-cpu", [*NO_REWARD, "algorithm.guide_failed_groups=true"])
    )
    assert ": nothing should train; guidance writes the ground truth into every group" in guidance_only
    assert learned_from(load_config(PPOConfig, "tiny-cpu", [])).startswith("the reward alone")
