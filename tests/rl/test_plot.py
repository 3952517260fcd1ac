"""The run's plot: what drives the update is drawn, what stays constant for the run is not."""

from __future__ import annotations

import json

from rl_extension.app.plot import drawn_panels, generate_lanes, plot_run, plot_timeline


def _records(guided: bool) -> list[dict]:
    records = []
    for step in range(1, 6):
        r = {
            "step": step,
            "reward/score": 0.1 * step,
            "actor/ppo_kl": 0.0,  # one on-policy epoch: no KL between old and new policy
            "actor/pg_clipfrac": 0.0,  # and nothing clipped
            "actor/entropy": 1.0 - 0.01 * step,
        }
        if guided:
            r |= {"actor/sft_loss": 2.0 / step, "guidance/guided_group_frac": 0.5 / step}
        records.append(r)
    records.append({"step": 5, "val/accuracy": 0.9})
    records.insert(0, {"step": 0, "val/accuracy": 0.5})
    return records


def test_constant_panels_are_left_out_and_the_drivers_drawn_when_on(tmp_path):
    reward_only = drawn_panels(_records(guided=False))
    assert set(reward_only) == {"held-out accuracy", "training reward", "entropy"}
    guided = drawn_panels(_records(guided=True))
    assert set(guided) - set(reward_only) == {
        "supervised term (actor.sft_loss_coef)",
        "guided groups (algorithm.guide_failed_groups)",
    }
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in _records(guided=True)))
    png = plot_run(tmp_path)
    assert png.endswith("metrics.png") and (tmp_path / "plots" / "metrics.png").stat().st_size > 0


def test_batches_generating_at_once_get_lanes_of_their_own(tmp_path):
    spans = [  # two batches in flight: b1 and b2 overlap, b1's second chunk follows its first
        {"kind": "generate", "start": 0.0, "end": 2.0, "batch": 1, "version": 0},
        {"kind": "generate", "start": 1.0, "end": 3.0, "batch": 2, "version": 0},
        {"kind": "generate", "start": 2.0, "end": 4.0, "batch": 1, "version": 1},
        {"kind": "generate", "start": 3.5, "end": 5.0, "batch": 3, "version": 1},
        {"kind": "generate", "start": 3.8, "end": 4.5, "batch": 4, "version": 1},
    ]
    assert generate_lanes(spans) == [0, 1, 0, 1, 2]
    assert generate_lanes([]) == []
    train = {"kind": "train", "start": 2.0, "end": 3.0, "step": 1}
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in [*spans, train]))
    assert plot_timeline(tmp_path).endswith("timeline.png")
