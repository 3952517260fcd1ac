"""benchmarks/rl/score_models.py: fresh problems outside the demo's splits, and the paired comparison."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from repo_scripts import script_with_its_folder


@pytest.fixture(scope="module")
def score_models():
    with script_with_its_folder("benchmarks/rl/score_models.py", "score_models") as module:
        yield module


def _prompts(path) -> list[str]:
    return pq.read_table(path).column("prompt").to_pylist()


def test_fresh_problems_are_in_none_of_the_demos_splits(score_models, tmp_path):
    from rl_extension.app.demo import make_demo_data

    demo = make_demo_data(tmp_path / "demo")
    seen = {p for split in demo.values() for p in _prompts(split)}
    assert len(seen) == score_models.DEMO_PROBLEMS  # the splits are the stream's first problems
    fresh = _prompts(score_models.fresh_problems(tmp_path / "fresh", 500))
    assert len(fresh) == len(set(fresh)) == 500
    assert not seen & set(fresh)


def test_the_comparison_counts_the_problems_only_one_model_gets_right(score_models):
    report = score_models.compare({"a": [1.0, 1.0, 1.0, 0.0, 0.0], "b": [1.0, 0.0, 0.0, 1.0, 0.0]})
    assert report["models"]["a"]["right"] == 3 and report["models"]["b"]["right"] == 2
    low, high = report["models"]["a"]["ci95"]
    assert low < 0.6 < high
    (pair,) = report["pairs"]
    assert (pair["a"], pair["b"], pair["only_a"], pair["only_b"]) == ("a", "b", 2, 1)
    assert pair["p"] == pytest.approx(1.0)  # 2 against 1 is no evidence
    # 30 against 10: p = 2 * P(X <= 10), X ~ Binomial(40, 1/2)
    assert score_models.sign_test_p(30, 10) == pytest.approx(0.002221, rel=1e-3)
    assert score_models.sign_test_p(10, 30) == score_models.sign_test_p(30, 10)
    table = score_models.markdown(report)
    assert "| a | 3 / 5 | 60.00% |" in table and "| a | b | 2 | 1 | +20.00 |" in table


def test_scores_checkpoints_on_the_fresh_problems(score_models, tmp_path, capsys):
    from rl_extension.models import build_tiny_model

    model = build_tiny_model(
        tmp_path / "tiny", num_layers=1, hidden_size=64, num_heads=2, intermediate_size=128
    )
    out = tmp_path / "report.json"
    argv = [f"x={model}", f"y={model}", "--num-problems", "24", "--data-dir", str(tmp_path / "data")]
    assert score_models.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [m["total"] for m in report["models"].values()] == [24, 24]
    assert report["models"]["x"]["right"] == report["models"]["y"]["right"]  # the same model, greedy
    assert report["pairs"][0]["only_a"] == report["pairs"][0]["only_b"] == 0
    assert out.with_suffix(".md").read_text() in capsys.readouterr().out


def test_a_model_argument_must_name_a_checkpoint(score_models, tmp_path, capsys):
    with pytest.raises(SystemExit):
        score_models.main([f"x={tmp_path}"])
    assert "is not NAME=PATH with a Hugging Face checkpoint" in capsys.readouterr().err
