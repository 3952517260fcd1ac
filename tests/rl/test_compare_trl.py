"""benchmarks/rl/compare_trl.py: the engines of one invocation, each with its own learning rate (an lr sweep)."""

from __future__ import annotations

import sys

import pytest
from repo_scripts import script_with_its_folder


@pytest.fixture(scope="module")
def compare_trl():
    with script_with_its_folder("benchmarks/rl/compare_trl.py", "compare_trl") as module:
        yield module


def test_each_engine_may_carry_its_own_lr(compare_trl):
    parse = compare_trl.parse_engine
    assert parse("trl", 5e-5) == ("trl", 5e-5, [])
    assert parse("trl@lr=3e-4", 5e-5) == ("trl", 3e-4, [])
    assert parse("ours@lr=1e-3@rollout.n=2", 5e-5) == ("ours", 1e-3, ["rollout.n=2"])
    for bad in ("trl@rollout.n=2", "verl", "ours@n"):
        with pytest.raises(ValueError, match="is not ours, trl"):
            parse(bad, 5e-5)


def test_a_decaying_schedule_needs_the_steps_it_decays_over(compare_trl, capsys):
    with pytest.raises(SystemExit):
        compare_trl.main(["--mode", "learn", "--lr-schedule", "cosine"])
    assert "--lr-schedule cosine needs --max-steps" in capsys.readouterr().err


def test_both_engines_decay_along_the_same_curve(compare_trl):
    """transformers' cosine_with_min_lr (TRL's) and ours' scheduler give the same learning rates."""
    import torch
    from transformers import get_scheduler

    from rl_extension.fsdp import build_scheduler

    engines, steps = sys.modules["engines"], 40
    trl_args = engines.TRL_LR_SCHEDULES["cosine"]

    def rates(make) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
        schedule, seen = make(optimizer), []
        for _ in range(steps):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            schedule.step()
        return seen

    theirs = rates(
        lambda o: get_scheduler(
            trl_args["lr_scheduler_type"],
            o,
            num_warmup_steps=0,
            num_training_steps=steps,
            scheduler_specific_kwargs=trl_args["lr_scheduler_kwargs"],
        )
    )
    ours = rates(
        lambda o: build_scheduler(o, total_steps=steps, schedule="cosine", min_lr_ratio=engines.MIN_LR_RATIO)
    )
    assert ours == pytest.approx(theirs, rel=1e-9)
    assert theirs[0] == pytest.approx(3e-4) and theirs[-1] < 0.12 * 3e-4


def test_the_table_of_a_run_that_ended_within_its_warm_up_has_no_step_times(compare_trl):
    """A run shorter than --warmup has no timed steps: its cells say so instead of the table failing."""
    steps = [{"step": i, "step_s": 0.2, "loop_s": 0.21, "cpu_s": 0.19} for i in (1, 2, 3)]
    validations = [
        {"step": 0, "accuracy": 0.55, "seconds": 0.5},
        {"step": 2, "accuracy": 0.6, "seconds": 0.5},
    ]
    round_ = {
        "startup_s": 8.0,
        "steps": steps,
        "validations": validations,
        "stop_reason": "steps done",
        "load_avg_1min": {"min": 1.0, "mean": 1.1, "max": 1.2},
        "wall_s": 10.0,
    }
    cfg = {"mode": "learn", "task": "addition", "rollout": "hf", "precision": "fp32", "warmup": 5}
    cfg |= {"target_points": 100.0, "lr": 3e-4, "lr_schedule": "cosine", "prompts": 8, "generations": 2}
    cfg |= {"workers": 2, "threads": 2}
    summary = compare_trl.summarize([round_], cfg["warmup"], cfg["target_points"])
    report = {"config": cfg, "machine": "test", "runs": {"trl": {"summary": summary, "rounds": [round_]}}}
    table = compare_trl.markdown(report)
    assert "| s/step, 10th / 90th percentile | — |" in table and ", cosine, precision fp32" in table
