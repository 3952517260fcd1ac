"""The learning target of the RL demo: ``spmdcall-rl demo`` for several seeds, one after the other.

Each seed runs the whole demo (tiny model -> addition data -> SFT warm start -> GRPO on 2 workers,
process backend) and reports the held-out accuracy before and after GRPO and the wall time; the
table this prints is the one in docs/rl/results.md. ``--controls`` runs, per seed and from the same
warm start, the same recipe with the reward removed and, where the recipe reads demonstrations, SFT
continued for the recipe's GRPO minutes (``rl_extension.app.controls``): the table then has the reward's
own gain as a column, the recipe's accuracy less the reward-removed control's.

    python benchmarks/rl/demo_seeds.py --seeds 0 1 2 --out runs/demo-seeds     # make demo-seeds
    python benchmarks/rl/demo_seeds.py --controls --out runs/demo-seeds          # with the controls
    python benchmarks/rl/demo_seeds.py --controls --keep-done --out runs/demo-seeds  # add the controls only
    python benchmarks/rl/demo_seeds.py --task calc --out runs/calc-seeds       # with the calc tool
    python benchmarks/rl/demo_seeds.py --task calc --no-tool --out runs/calc-notool-seeds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from rl_extension.app.cli import run_demo
from rl_extension.app.controls import run_controls


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _controls(r: dict) -> list[str]:
    """The control cells of a row: reward removed, SFT continued, and the reward's own gain."""
    own = r["accuracy_after"] - r["no_reward_after"]
    return [_pct(r["no_reward_after"]), _pct(r["sft_more_after"]), f"{100 * own:+.1f}"]


def _cells(r: dict, name: str, steps: str, controls: bool) -> str:
    gain = r["accuracy_after"] - r["accuracy_before"]
    cells = [name, steps, _pct(r["accuracy_before"]), _pct(r["accuracy_after"]), f"{100 * gain:+.1f}"]
    cells += _controls(r) if controls else []
    cells += [f"{r[k] / 60:.1f}" for k in ("sft_s", "grpo_s", "total_s")]
    return "| " + " | ".join(cells) + " |"


def markdown_table(rows: list[dict]) -> str:
    """One line per seed plus the mean: accuracy before/after GRPO, gain, SFT steps, minutes; with the
    controls where they ran (the same recipe with the reward removed, SFT continued for the same
    minutes, and the reward's own gain: after GRPO less reward removed)."""
    controls = all("no_reward_after" in r for r in rows)
    head = ["seed", "SFT steps", "accuracy after SFT", "after GRPO", "gain (points)"]
    head += ["reward removed", "SFT continued", "reward's own gain"] if controls else []
    head += ["SFT min", "GRPO min", "total min"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    lines += [_cells(r, str(r["seed"]), str(r["sft_steps"]), controls) for r in rows]
    keys = ["accuracy_before", "accuracy_after", "sft_s", "grpo_s", "total_s"]
    mean: dict = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    if controls:
        mean["no_reward_after"] = sum(r["no_reward_after"] for r in rows) / len(rows)
        sft_more = [r["sft_more_after"] for r in rows if r["sft_more_after"] is not None]
        mean["sft_more_after"] = sum(sft_more) / len(sft_more) if len(sft_more) == len(rows) else None
    lines.append(_cells(mean, "mean", "", controls))
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
    parser.add_argument(
        "--controls",
        action="store_true",
        help="also run each seed's controls: the reward removed, and SFT continued for the same minutes",
    )
    parser.add_argument(
        "--keep-done",
        action="store_true",
        help="keep the seeds already in --out's results.json (run only the controls they lack)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value for the GRPO config; sft.key=value for SFT")
    args = parser.parse_args()
    out = Path(args.out)
    sft = [o.removeprefix("sft.") for o in args.overrides if o.startswith("sft.")]
    grpo = [o for o in args.overrides if not o.startswith("sft.")]
    results = out / "results.json"
    done = (
        {r["seed"]: r for r in json.loads(results.read_text())} if args.keep_done and results.exists() else {}
    )
    rows = []
    for seed in args.seeds:
        row = done.get(seed)
        if row is None:
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
            row = {"seed": seed, **summary}
        missing = tuple(c for c in ("no_reward", "sft_more") if row.get(f"{c}_after") is None)
        if args.controls and missing:
            row |= run_controls(
                Path(row["run_dir"]).parent,  # the seed's demo directory, wherever it ran
                row,
                seed=seed,
                backend=args.backend,
                train_overrides=grpo,
                sft_overrides=sft,
                which=missing,
            )
        rows.append(row)
        results.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for s, r in done.items() if s not in {row["seed"] for row in rows}]  # not (yet) redone
        results.write_text(json.dumps(rows + kept, indent=2))
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end"
    )
    table = markdown_table(rows)
    learned = f"Learned from: {rows[0]['learned_from']}."
    (out / "results.md").write_text(f"{table}\n\n{learned}\nMachine: {machine}.\n")
    print(
        f"\n{table}\n\n{learned}\nMachine: {machine}.\nWritten to {out / 'results.md'} and {out / 'results.json'}"
    )


if __name__ == "__main__":
    main()
