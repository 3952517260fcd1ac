"""benchmarks/bench_async_addition.py: the bound it prints beside the result, and what each mode's run
asks of the trainer (the runs faked: no training)."""

from __future__ import annotations

import pytest
from repo_scripts import ROOT, load_script


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as when run: it imports bench_async beside it
    return load_script("benchmarks/bench_async_addition.py", "bench_async_addition")


def test_the_bound_is_the_sync_step_over_the_longer_async_side(bench):
    sync = {"gen_s": 0.15, "train_s": 0.25}
    ratio, text = bench.bound(sync, {"gen_s": 0.3, "train_s": 0.2})  # the rollout binds
    assert ratio == pytest.approx(0.4 / 0.3)
    assert "(G 0.150 + T 0.250 = 0.400 s) / max(G_async 0.300, T_async 0.200) = 0.400 / 0.300" in text
    assert bench.bound(sync, {"gen_s": 0.1, "train_s": 0.5})[0] == pytest.approx(0.8)  # the trainer binds


def test_each_mode_runs_its_layout_and_too_few_steps_are_refused(bench, monkeypatch, capsys):
    seen = []

    def fake_run(mode, args, run_dir):
        seen.append((mode, args.async_layout, args.model))
        return {
            "samples_per_s": 100.0 if mode == "sync" else 125.0,
            "step_s": 0.5,
            "gen_s": 0.2,
            "train_s": 0.3,
        }

    monkeypatch.setattr(bench, "run", fake_run)
    bench.main(["--rounds", "2", "--steps", "5", "--model", "warm"])
    sync, async_ = ("sync", "one-each", "warm"), ("async", "one-each", "warm")
    assert seen == [sync, async_, async_, sync]  # the order alternates by round
    out = capsys.readouterr().out
    assert "sync 100.0, async 125.0, async/sync 1.25x (bound from the measured parts 1.67x)" in out
    assert bench.LAYOUTS["one-each"] == [
        "trainer.num_workers=1",
        "trainer.rollout_workers=1",
        "trainer.threads_per_worker=1",
    ]
    with pytest.raises(SystemExit):
        bench.main(["--steps", "2"])
    assert "--steps must be more than 2, got 2" in capsys.readouterr().err
