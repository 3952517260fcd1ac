"""The learning target of the RL demo: ``spmdcall-rl demo`` for several seeds, one after the other.

Each seed runs the whole demo (tiny model -> addition data -> SFT warm start -> GRPO on 2 workers,
process backend) and reports the held-out accuracy before and after GRPO and the wall time; the
table this prints is the one in docs/rl/results.md.

    python benchmarks/rl/demo_seeds.py --seeds 0 1 2 --out runs/demo-seeds     # make demo-seeds
    python benchmarks/rl/demo_seeds.py --task calc --out runs/calc-seeds       # with the calc tool
    python benchmarks/rl/demo_seeds.py --task calc --no-tool --out runs/calc-notool-seeds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from rl_extension.cli import run_demo


def markdown_table(rows: list[dict]) -> str:
    """One line per seed plus the mean: accuracy before/after GRPO, gain, SFT steps, minutes."""
    lines = [
        "| seed | SFT steps | accuracy after SFT | after GRPO | gain (points) | SFT min | GRPO min | total min |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['sft_steps']} | {100 * r['accuracy_before']:.1f}% | {100 * r['accuracy_after']:.1f}% "
            f"| {100 * (r['accuracy_after'] - r['accuracy_before']):+.1f} | {r['sft_s'] / 60:.1f} "
            f"| {r['grpo_s'] / 60:.1f} | {r['total_s'] / 60:.1f} |"
        )
    n = len(rows)
    mean = {
        k: sum(r[k] for r in rows) / n
        for k in ("accuracy_before", "accuracy_after", "sft_s", "grpo_s", "total_s")
    }
    lines.append(
        f"| mean | | {100 * mean['accuracy_before']:.1f}% | {100 * mean['accuracy_after']:.1f}% "
        f"| {100 * (mean['accuracy_after'] - mean['accuracy_before']):+.1f} | {mean['sft_s'] / 60:.1f} "
        f"| {mean['grpo_s'] / 60:.1f} | {mean['total_s'] / 60:.1f} |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/demo-seeds")
    parser.add_argument("--backend", default="process")
    parser.add_argument("--task", default="addition", choices=["addition", "calc"])
    parser.add_argument("--no-tool", action="store_true", help="--task calc without the tool")
    parser.add_argument(
        "--reuse-sft",
        action="store_true",
        help="keep a finished SFT of the same config under --out (per seed)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value for the GRPO config; sft.key=value for SFT")
    args = parser.parse_args()
    out = Path(args.out)
    sft = [o.removeprefix("sft.") for o in args.overrides if o.startswith("sft.")]
    grpo = [o for o in args.overrides if not o.startswith("sft.")]
    rows = []
    for seed in args.seeds:
        summary = run_demo(
            out / f"seed{seed}",
            seed=seed,
            backend=args.backend,
            train_overrides=grpo,
            sft_overrides=sft,
            task=args.task,
            use_tool=not args.no_tool,
            reuse_sft=args.reuse_sft,
        )
        rows.append({"seed": seed, **summary})
        (out / "results.json").write_text(json.dumps(rows, indent=2))
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end"
    )
    table = markdown_table(rows)
    (out / "results.md").write_text(f"{table}\n\nMachine: {machine}.\n")
    print(f"\n{table}\n\nMachine: {machine}.\nWritten to {out / 'results.md'} and {out / 'results.json'}")


if __name__ == "__main__":
    main()
