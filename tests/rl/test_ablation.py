"""benchmarks/rl/ablation.py: each variant adds its overrides to those before it; --keep-done and
--only fill a table in parts without losing the rows already made (run_demo faked: no training)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from repo_scripts import load_script


@pytest.fixture
def ablation(monkeypatch):
    module = load_script("benchmarks/rl/ablation.py", "ablation")
    calls: list[dict] = []

    def fake_run_demo(out, *, seed, backend, train_overrides, sft_overrides, reuse_sft):
        calls.append({"seed": seed, "out": Path(out), "train": train_overrides, "sft": sft_overrides})
        # An accuracy that tells the runs apart: seed and number of overrides.
        after = 0.5 + seed / 10 + len(train_overrides) / 100
        return {"accuracy_before": 0.5, "accuracy_after": after, "total_s": 60.0 * seed}

    monkeypatch.setattr(module, "run_demo", fake_run_demo)
    module.calls = calls
    return module


def _main(ablation, monkeypatch, *argv: str) -> list[dict]:
    ablation.calls.clear()
    monkeypatch.setattr(sys, "argv", ["ablation.py", *argv])
    ablation.main()
    return ablation.calls


def test_each_variant_keeps_the_overrides_of_those_before_it(ablation, monkeypatch, tmp_path):
    calls = _main(
        ablation, monkeypatch, "--seeds", "3", "--variants", "sft-term,sft-beta2,prompts-128x2",
        "--out", str(tmp_path), "preset=tiny-cpu-ppo", "sft.lr=1e-3",
    )  # fmt: skip
    assert [c["seed"] for c in calls] == [3, 3, 3]
    term, beta2, prompts = (c["train"] for c in calls)
    assert term[: len(ablation.BEFORE_BATCH) + 1] == [*ablation.BEFORE_BATCH, "preset=tiny-cpu-ppo"]
    assert term[-2:] == ["actor.sft_loss_coef=1.0", f"trainer.run_dir={tmp_path}/seed3/grpo-sft-term"]
    # sft-beta2 changes only the SFT: a warm start of its own, which the variant after it shares.
    assert beta2[:-1] == term[:-1]
    assert calls[1]["sft"] == [*ablation.BEFORE_SFT, "lr=1e-3", "betas=[0.9,0.98]"]
    assert calls[1]["out"] == calls[2]["out"] == tmp_path / "seed3-sft-beta2"
    assert prompts[:-1] == [*term[:-1], *ablation.CHANGES["prompts-128x2"]]
    assert calls[0]["out"] == tmp_path / "seed3"
    table = (tmp_path / "results.md").read_text()
    assert "| prompts-128x2 |" in table and "| sft-term |" in table


def test_only_fills_a_table_in_parts_and_keep_done_keeps_every_row(ablation, monkeypatch, tmp_path):
    chain = ["--variants", "before,sft-term,prompts-128x2", "--keep-done", "--out", str(tmp_path)]
    calls = _main(ablation, monkeypatch, "--seeds", "1", "2", *chain, "--only", "prompts-128x2")
    assert len(calls) == 2
    # The skipped variants still give their overrides to the one that ran.
    assert "actor.sft_loss_coef=1.0" in calls[0]["train"] and "actor.lr=1e-4" in calls[0]["train"]
    calls = _main(ablation, monkeypatch, "--seeds", "1", *chain, "--only", "before")
    assert [c["train"][-1].rsplit("/", 1)[1] for c in calls] == ["grpo-before"]
    rows = json.loads((tmp_path / "results.json").read_text())
    assert sorted((r["seed"], r["variant"]) for r in rows) == [
        (1, "before"),
        (1, "prompts-128x2"),
        (2, "prompts-128x2"),
    ]
    # The whole chain again: only the rows not made yet run.
    calls = _main(ablation, monkeypatch, "--seeds", "1", "2", *chain)
    assert sorted((c["seed"], c["train"][-1].rsplit("/", 1)[1]) for c in calls) == [
        (1, "grpo-sft-term"),
        (2, "grpo-before"),
        (2, "grpo-sft-term"),
    ]
    rows = json.loads((tmp_path / "results.json").read_text())
    assert len(rows) == 6


def test_only_names_variants_of_the_chain(ablation, monkeypatch, tmp_path, capsys):
    argv = ["--variants", "before,sft-term", "--only", "sft-beta2", "--out", str(tmp_path)]
    with pytest.raises(SystemExit):
        _main(ablation, monkeypatch, *argv)
    assert "--only: ['sft-beta2'] not in --variants ['before', 'sft-term']" in capsys.readouterr().err


def test_controls_run_for_every_variant_and_give_the_rewards_own_gain(ablation, monkeypatch, tmp_path):
    controls: list[tuple] = []

    def fake_run_controls(demo_dir, recipe, *, seed, backend, train_overrides, sft_overrides, name):
        controls.append((seed, name, Path(demo_dir)))
        return {"no_reward_after": recipe["accuracy_after"] - 0.25, "sft_more_after": 0.6}

    monkeypatch.setattr(ablation, "run_controls", fake_run_controls)
    calls = _main(
        ablation,
        monkeypatch,
        "--seeds",
        "0",
        "--variants",
        "before,sft-term",
        "--controls",
        "--out",
        str(tmp_path),
    )
    assert [c[:2] for c in controls] == [(0, "-before"), (0, "-sft-term")]
    assert [c[2] for c in controls] == [c["out"] for c in calls]  # from the variant's own warm start
    table = (tmp_path / "results.md").read_text()
    assert "| reward removed, mean | SFT continued, mean | reward's own gain |" in table
    assert all(line.split(" | ")[-2] == "+25.0" for line in table.splitlines() if line.startswith("| before"))


def test_the_digit_credit_reward_of_the_credit_assignment_row_loads_by_its_path():
    """benchmarks/rl/shaped_rewards.py, the experiment log's credit-assignment row: a reward.scorer given
    as a file path; only the exact sum scores 1.0, so the accuracy it reports is the demo's."""
    from repo_scripts import ROOT

    from rl_extension.data.scorers import get_scorer

    score = get_scorer(f"{ROOT / 'benchmarks/rl/shaped_rewards.py'}:digit_credit")
    assert score("1282", "1282") == 1.0 and score(" 1282 ", "1282") == 1.0
    assert score("1283", "1282") == pytest.approx(0.675) and score("1382", "1282") == pytest.approx(0.675)
    assert score("282", "1282") == pytest.approx(0.675) and score("2821", "1282") == 0.0
    assert score("12 82", "1282") == 0.0 and score("", "1282") == 0.0
