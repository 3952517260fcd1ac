"""benchmarks/report.py: ratios to baselines, targets met or missed, the table spliced into a page."""

from __future__ import annotations

import json
import sys

import pytest
from repo_scripts import load_script


@pytest.fixture(scope="module")
def report():
    yield load_script("benchmarks/report.py", "bench_report")
    del sys.modules["bench_report"]


def _bench(group, label, median, *, baseline=None, target_s=None, target_ratio=None):
    """One entry as pytest-benchmark writes it, labelled by the ``case`` fixture of benchmarks/."""
    return {
        "group": group,
        "name": f"test_{label}",
        "extra_info": {
            "label": label,
            "baseline": baseline,
            "target_s": target_s,
            "target_ratio": target_ratio,
        },
        "stats": {"median": median, "iqr": median / 10, "rounds": 7},
    }


@pytest.fixture
def results(tmp_path):
    data = {
        "datetime": "2026-11-25T08:00:00.000000",
        "machine_info": {"cpu": {"brand_raw": "Test CPU"}, "python_version": "3.11.7"},
        "benchmarks": [
            _bench("1. no-op", "raw", 200e-6),
            _bench("1. no-op", "ours", 100e-6, baseline="raw", target_s=150e-6),
            _bench("2. echo", "floor", 4e-3),
            _bench("2. echo", "ours", 12e-3, baseline="floor", target_ratio=2.0),
        ],
    }
    path = tmp_path / "latest.json"
    path.write_text(json.dumps(data))
    return path


def test_the_table_gives_ratios_and_judges_targets(report, results, capsys):
    assert report.main([str(results)]) == 0
    table = capsys.readouterr().out
    assert "Targets: 1 of 2 met (missed: ours in '2. echo')." in table
    assert "| ours | 100 µs | 10 µs | 7 | 0.50× raw | ≤ 150 µs: met |" in table
    assert "| ours | 12 ms | 1.2 ms | 7 | 3.00× floor | ≤ 2× baseline: missed |" in table
    assert table.index("### 1. no-op") < table.index("### 2. echo")


def test_a_case_that_times_its_own_sides_says_so_in_place_of_a_baseline(report, tmp_path, capsys):
    pairs = _bench("3. pairs", "a + b, alternating", 3e-3)
    pairs["extra_info"]["versus"] = "a 1800 µs / b 1200 µs = 1.50×"
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps({"datetime": "2026-11-28T15:00:00", "benchmarks": [pairs]}))
    assert report.main([str(path)]) == 0
    assert (
        "| a + b, alternating | 3 ms | 300 µs | 7 | a 1800 µs / b 1200 µs = 1.50× |  |"
        in capsys.readouterr().out
    )


def test_sides_timed_round_by_round_are_rows_of_their_own(report, tmp_path, capsys):
    rounds = _bench("4. start", "one round of every side", 9.0)
    rounds["extra_info"]["sides"] = [
        {"label": "bare", "times": [2.0, 1.0, 3.0]},
        {"label": "ours", "times": [0.1, 0.3, 0.2, 0.2], "baseline": "bare", "target_s": 0.25},
    ]
    path = tmp_path / "sides.json"
    path.write_text(json.dumps({"datetime": "2026-12-01T15:00:00", "benchmarks": [rounds]}))
    assert report.main([str(path)]) == 0
    table = capsys.readouterr().out
    assert "one round of every side" not in table
    assert "| bare | 2 s | 1 s | 3 | baseline |  |" in table
    assert "| ours | 200 ms | 50 ms | 4 | 0.10× bare | ≤ 250 ms: met |" in table


def test_the_table_replaces_what_stands_between_the_pages_markers(report, results, tmp_path, capsys):
    page = tmp_path / "benchmarks.md"
    page.write_text(
        "# Benchmarks\n\nIntro.\n\n<!-- bench-table -->\nold table\n<!-- /bench-table -->\n\nAfter.\n"
    )
    assert report.main([str(results), "--page", str(page), "--png", str(tmp_path / "chart.png")]) == 0
    text = page.read_text()
    assert (
        "old table" not in text
        and text.startswith("# Benchmarks\n\nIntro.\n")
        and text.endswith("\nAfter.\n")
    )
    assert text.count("| ours |") == 2 and text.count("<!-- bench-table -->") == 1
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()

    page.write_text("# No markers\n")
    assert report.main([str(results), "--page", str(page)]) == 1
    assert "needs one <!-- bench-table --> line" in capsys.readouterr().err
    assert page.read_text() == "# No markers\n"  # left as it was
