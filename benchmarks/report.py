"""Turn pytest-benchmark's JSON into a Markdown table and a PNG chart of ratios to the baselines.

    .venv/bin/python -m pytest benchmarks --benchmark-only --benchmark-json=.benchmarks/latest.json
    .venv/bin/python benchmarks/report.py .benchmarks/latest.json --png docs/benchmarks.png --page docs/benchmarks.md

Every benchmark carries, in ``extra_info`` (set by the ``case`` fixture of ``conftest.py``), a
readable ``label``, the ``baseline`` label it is compared with inside its group (None for a
baseline), and optionally a target: ``target_s`` (median at most this many seconds) or
``target_ratio`` (median at most this many times its baseline's). Benchmarks without a label (run
outside ``make bench``) appear under their test name, without a ratio. A benchmark that timed
several sides round by round (interleaved) lists them in ``extra_info["sides"]``, each with its
label, times, baseline and target: each side is a row, in place of the benchmark's own.

The table (one section per group, groups in name order) is printed to stdout, and written to
``--md`` if given; ``--page`` puts it into a Markdown page in place of what stands between the
page's ``<!-- bench-table -->`` and ``<!-- /bench-table -->`` lines; ``--png`` draws one panel per group, a bar per case showing its median as a
multiple of its baseline's (log scale), green where a target is met, red where it is missed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Row:
    """One benchmark of the JSON, with what the report needs."""

    group: str
    label: str
    median: float
    iqr: float
    rounds: int
    baseline: str | None
    target_s: float | None
    target_ratio: float | None
    ratio: float | None = None  # median / the baseline's median
    versus: str | None = None  # what a case that times its own sides says of them (``extra_info``)

    @property
    def target_met(self) -> bool | None:
        if self.target_s is not None:
            return self.median <= self.target_s
        if self.target_ratio is not None and self.ratio is not None:
            return self.ratio <= self.target_ratio
        return None

    def target_text(self) -> str:
        if self.target_s is not None:
            goal = f"≤ {format_time(self.target_s)}"
        elif self.target_ratio is not None:
            goal = f"≤ {self.target_ratio:g}× baseline"
        else:
            return ""
        met = self.target_met
        return f"{goal}: {'met' if met else 'missed' if met is not None else 'no baseline'}"


def format_time(seconds: float) -> str:
    """Seconds in the unit that gives 1 to 999 of it: ``0.000123`` -> ``123 µs``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if seconds >= scale or unit == "ns":
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def load_rows(data: dict[str, Any]) -> list[Row]:
    """The benchmarks of a pytest-benchmark JSON document, each with its ratio to its baseline."""
    rows = []
    for bench in data.get("benchmarks", []):
        info, stats = bench.get("extra_info", {}), bench["stats"]
        if "sides" in info:  # a case that timed its sides round by round: a row for each side
            rows += [_side_row(bench.get("group") or "(no group)", side) for side in info["sides"]]
            continue
        rows.append(
            Row(
                group=bench.get("group") or "(no group)",
                label=info.get("label") or bench["name"],
                median=stats["median"],
                iqr=stats["iqr"],
                rounds=stats["rounds"],
                baseline=info.get("baseline"),
                target_s=info.get("target_s"),
                target_ratio=info.get("target_ratio"),
                versus=info.get("versus"),
            )
        )
    by_label = {(r.group, r.label): r for r in rows}
    for r in rows:
        base = by_label.get((r.group, r.baseline)) if r.baseline else None
        if base is not None and base.median > 0:
            r.ratio = r.median / base.median
    return rows


def _side_row(group: str, side: dict[str, Any]) -> Row:
    times = sorted(side["times"])
    quartiles = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [times[0]] * 3
    return Row(
        group=group,
        label=side["label"],
        median=statistics.median(times),
        iqr=quartiles[2] - quartiles[0],
        rounds=len(times),
        baseline=side.get("baseline"),
        target_s=side.get("target_s"),
        target_ratio=side.get("target_ratio"),
    )


def groups_of(rows: list[Row]) -> dict[str, list[Row]]:
    """Rows by group (groups in name order); inside a group, baselines first, then by median."""
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.group, []).append(r)
    return {g: sorted(groups[g], key=lambda r: (r.baseline is not None, r.median)) for g in sorted(groups)}


def markdown(rows: list[Row], data: dict[str, Any]) -> str:
    lines = []
    machine, when = data.get("machine_info", {}), data.get("datetime", "")
    cpu = machine.get("cpu", {}).get("brand_raw") or machine.get("processor") or "unknown CPU"
    judged = [r for r in rows if r.target_met is not None]
    missed = [r for r in judged if not r.target_met]
    lines.append(
        f"Measured {when[:19].replace('T', ' ')} UTC on {cpu}, Python {machine.get('python_version', '?')}. "
        f"Targets: {len(judged) - len(missed)} of {len(judged)} met"
        + (f" (missed: {', '.join(f'{r.label} in {r.group!r}' for r in missed)})." if missed else ".")
    )
    for group, members in groups_of(rows).items():
        lines += [
            "",
            f"### {group}",
            "",
            "| case | median | IQR | rounds | vs baseline | target |",
            "| --- | ---: | ---: | ---: | --- | --- |",
        ]
        for r in members:
            if r.versus is not None:
                versus = r.versus
            elif r.baseline is None:
                versus = "baseline"
            elif r.ratio is None:
                versus = f"(no {r.baseline!r} in this run)"
            else:
                versus = f"{r.ratio:.2f}× {r.baseline}"
            lines.append(
                f"| {r.label} | {format_time(r.median)} | {format_time(r.iqr)} | {r.rounds} | {versus} | {r.target_text()} |"
            )
    return "\n".join(lines) + "\n"


PAGE_START, PAGE_END = "<!-- bench-table -->", "<!-- /bench-table -->"


def splice(page: str, table: str) -> str:
    """``page`` with ``table`` in place of what stands between its table markers."""
    lines = page.splitlines(keepends=True)
    marks = [line.strip() for line in lines]
    if (
        marks.count(PAGE_START) != 1
        or marks.count(PAGE_END) != 1
        or marks.index(PAGE_START) > marks.index(PAGE_END)
    ):
        raise ValueError(f"the page needs one {PAGE_START} line, then one {PAGE_END} line")
    start, end = marks.index(PAGE_START), marks.index(PAGE_END)
    return "".join(lines[: start + 1]) + "\n" + table + "\n" + "".join(lines[end:])


def chart(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = groups_of(rows)
    heights = [len(members) + 1.2 for members in groups.values()]
    fig, axes = plt.subplots(
        len(groups),
        1,
        figsize=(11, 0.32 * sum(heights) + 1.2),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    all_ratios = [r.ratio for r in rows if r.ratio is not None] or [1.0]
    low, high = min(min(all_ratios) / 1.5, 0.5), max(max(all_ratios), 2.0) * 8
    for ax, (group, members) in zip(axes[:, 0], groups.items()):
        members = list(reversed(members))  # barh draws bottom-up: baselines on top
        ratios = [r.ratio if r.ratio is not None else 1.0 for r in members]
        colors = [
            "#9e9e9e"
            if r.baseline is None
            else {True: "#2e7d32", False: "#c62828", None: "#1565c0"}[r.target_met]
            for r in members
        ]
        # Bars grow from 1 (as fast as the baseline): to the right when slower, to the left when faster.
        ax.barh(range(len(members)), [ratio - 1.0 for ratio in ratios], left=1.0, color=colors, height=0.7)
        ax.plot(
            [1.0] * sum(r.baseline is None for r in members),
            [i for i, r in enumerate(members) if r.baseline is None],
            "D",
            color="#9e9e9e",
            markersize=5,
        )
        ax.set_xscale("log")
        ax.set_xlim(low, high)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks(range(len(members)), [r.label for r in members], fontsize=8)
        ax.set_title(group, fontsize=9, loc="left", fontweight="bold")
        ax.tick_params(axis="x", labelsize=7)
        for i, (r, ratio) in enumerate(zip(members, ratios)):
            text = format_time(r.median) + (
                "  (baseline)" if r.baseline is None else f"  {ratio:.2f}× {r.baseline}"
            )
            ax.text(max(ratio, 1.0) * 1.08, i, text, va="center", fontsize=7)
    axes[-1, 0].set_xlabel(
        "median time ÷ median of the case's baseline (log scale; left of 1: faster than it)\n"
        "grey: baseline · green: target met · red: target missed · blue: no target",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="the file written by pytest --benchmark-json")
    parser.add_argument("--md", help="also write the Markdown table here")
    parser.add_argument("--page", help="put the table into this Markdown page, between its table markers")
    parser.add_argument("--png", help="write the bar chart of ratios here")
    args = parser.parse_args(argv)
    data = json.loads(Path(args.json).read_text())
    rows = load_rows(data)
    if not rows:
        print(f"{args.json} holds no benchmarks", file=sys.stderr)
        return 1
    table = markdown(rows, data)
    sys.stdout.write(table)
    if args.md:
        Path(args.md).write_text(table)
    if args.page:
        page = Path(args.page)
        try:
            page.write_text(splice(page.read_text(), table))
        except ValueError as exc:
            print(f"{args.page}: {exc}", file=sys.stderr)
            return 1
    if args.png:
        chart(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
