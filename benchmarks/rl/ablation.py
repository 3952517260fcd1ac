"""Ablation of the demo's recipe: the recipe before, then each change added to the ones before it.

The variants of a seed start from the same SFT warm start (run once per seed, then reused: SFT is
deterministic per seed), each with its own run directory, ``--out/seed<N>/grpo-<variant>``. A
variant that changes the SFT itself (``sft.key=value``) gets a warm start of its own, in
``--out/seed<N>-<variant>``, which the variants after it share. It prints held-out accuracy after
GRPO per variant and seed, and the longest seed's minutes (SFT included, as timed when that SFT
ran); the ablation table of docs/rl/experiment-log.md is made from its results.json.

    python benchmarks/rl/ablation.py --seeds 0 1 2 --out runs/ablation
    python benchmarks/rl/ablation.py --variants before,sft-term --out runs/ablation   # some of them
    python benchmarks/rl/ablation.py --variants before,sft-term,lr-3e-4 --out runs/ablation-ppo preset=tiny-cpu-ppo sft.betas=[0.9,0.98]

The last variant of the default list is the guided recipe (presets tiny-cpu-guided and sft-tiny-cpu; the
demo until 2026-11-27; the demo itself, tiny-cpu, is ``before`` with the lr and batch of the last ones). PPO (``preset=tiny-cpu-ppo``) leaves
out ``guidance``: it needs group advantages, and the config refuses it with GAE.

``--controls`` runs each variant's controls from its warm start (``rl_extension.app.controls``): the same
variant with the reward removed and, where it reads demonstrations, SFT continued for its GRPO
minutes; the table then gives their mean accuracy and the reward's own gain beside each variant.

``--variants`` picks and orders the changes; each variant keeps the overrides of those listed
before it. Trailing ``key=value`` overrides go to every variant (``sft.key=value`` to the SFT).
``--keep-done`` keeps the rows of ``--out``/results.json that ran with the same overrides (a run of
a seed repeats its accuracy exactly), so an ablation cut short, or one with a variant added, runs
only what is missing; rows of other seeds or variants stay in results.json. ``--only`` runs some
variants of the chain and skips the others that are not done (they still give their overrides to
the variants after them), to fill a long table in the order that matters most:

    python benchmarks/rl/ablation.py --seeds 1 0 2 --variants lr-3e-4,sft-beta2,prompts-128x2 --keep-done
    python benchmarks/rl/ablation.py --variants before,sft-term,lr-3e-4,sft-beta2,prompts-128x2 \
        --only prompts-128x2 --keep-done --out runs/ablation-ppo preset=tiny-cpu-ppo
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from rl_extension.app.cli import run_demo
from rl_extension.app.controls import run_controls

# The warm start of every variant before sft-beta2 (the sft-tiny-cpu preset until 2026-11-26).
BEFORE_SFT = ["betas=[0.9,0.999]"]
# The batch of every variant before prompts-128x2 (the tiny-cpu preset until 2026-11-26).
BEFORE_BATCH = ["data.train_batch_size=16", "rollout.n=8", "actor.ppo_mini_batch_size=16"]
CHANGES: dict[str, list[str]] = {
    # The demo's GRPO recipe before the changes below (the tiny-cpu preset until 2026-11-26).
    "before": [
        "algorithm.guide_failed_groups=false",
        "actor.sft_loss_coef=0",
        "actor.lr=1e-4",
    ],
    # A group with no right sample gets the ground truth as one of its responses.
    "guidance": ["algorithm.guide_failed_groups=true"],
    # The demonstrations' negative log-likelihood joins the policy loss.
    "sft-term": ["actor.sft_loss_coef=1.0"],
    # Three times the learning rate: the supervised term keeps the larger steps stable. With the
    # three changes, this is the tiny-cpu preset.
    "lr-3e-4": ["actor.lr=3e-4"],
    # The warm start: AdamW's beta2 at 0.98 instead of 0.999 (the sft-tiny-cpu preset since
    # 2026-11-26), which brings SFT's jump in accuracy sooner.
    "sft-beta2": ["sft.betas=[0.9,0.98]"],
    # 128 prompts x 2 samples a step instead of 16 x 8 (the tiny-cpu preset since 2026-11-26): twice
    # the samples, eight times the problems, and with them the demonstrations of the
    # supervised term and of guidance. PPO's critic keeps its mini-batch (tiny-cpu-ppo: 16 prompts),
    # so it takes 8 steps where the actor takes one.
    "prompts-128x2": ["data.train_batch_size=128", "rollout.n=2", "actor.ppo_mini_batch_size=128"],
}


def markdown_table(rows: list[dict], variants: list[str], seeds: list[int]) -> str:
    """One line per variant: held-out accuracy before -> after GRPO per seed (a variant that changes
    the SFT starts elsewhere), the mean after, and the longest total time of a seed (SFT included)."""
    head = " | ".join(f"seed {s}" for s in seeds)
    controls = bool(rows) and all("no_reward_after" in r for r in rows)
    extra = " reward removed, mean | SFT continued, mean | reward's own gain |" if controls else ""
    lines = [
        f"| variant | {head} | mean after |{extra} longest seed, min |",
        "|---|" + "---:|" * (len(seeds) + 2 + 3 * controls),
    ]
    for variant in variants:
        done = {r["seed"]: r for r in rows if r["variant"] == variant}
        if not done:
            continue
        cells = [
            f"{100 * done[s]['accuracy_before']:.1f} → {100 * done[s]['accuracy_after']:.1f}% "
            f"({100 * (done[s]['accuracy_after'] - done[s]['accuracy_before']):+.1f})"
            if s in done
            else ""
            for s in seeds
        ]
        mean = sum(r["accuracy_after"] for r in done.values()) / len(done)
        longest = max(r["total_s"] for r in done.values()) / 60
        if controls:
            no_reward = sum(r["no_reward_after"] for r in done.values()) / len(done)
            sft_more = [r["sft_more_after"] for r in done.values() if r["sft_more_after"] is not None]
            more = f"{100 * sum(sft_more) / len(sft_more):.1f}%" if len(sft_more) == len(done) else "—"
            cells += [
                f"{100 * mean:.1f}%",
                f"{100 * no_reward:.1f}%",
                more,
                f"{100 * (mean - no_reward):+.1f}",
            ]
        else:
            cells.append(f"{100 * mean:.1f}%")
        lines.append(f"| {variant} | {' | '.join(cells)} | {longest:.1f} |")
    return "\n".join(lines)


def _save(results: Path, rows: list[dict], done: list[dict]) -> None:
    """Write this run's rows, and the done rows of the seeds and variants it did not touch."""
    touched = {(r["seed"], r["variant"]) for r in rows}
    others = [r for r in done if (r["seed"], r["variant"]) not in touched]
    results.write_text(json.dumps([*others, *rows], indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/ablation")
    parser.add_argument("--backend", default="process")
    parser.add_argument(
        "--variants",
        default=",".join(CHANGES),
        help=f"comma-separated, in order; of {', '.join(CHANGES)} (default all)",
    )
    parser.add_argument(
        "--keep-done",
        action="store_true",
        help="reuse the rows of --out/results.json with the same overrides",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated variants of --variants to run; the others not done are skipped (default all)",
    )
    parser.add_argument(
        "--controls",
        action="store_true",
        help="also run each variant's controls: the reward removed, and SFT continued for the same minutes",
    )
    parser.add_argument("overrides", nargs="*", help="key=value for every GRPO config; sft.key=value for SFT")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in CHANGES]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; expected some of {list(CHANGES)}")
    only = args.only.split(",") if args.only else variants
    if not set(only) <= set(variants):
        parser.error(f"--only: {sorted(set(only) - set(variants))} not in --variants {variants}")
    out = Path(args.out)
    sft = [o.removeprefix("sft.") for o in args.overrides if o.startswith("sft.")]
    common = [o for o in args.overrides if not o.startswith("sft.")]
    results = out / "results.json"
    done = json.loads(results.read_text()) if args.keep_done and results.exists() else []
    rows: list[dict] = []
    for seed in args.seeds:
        overrides, sft_overrides, demo_dir = (
            [*BEFORE_BATCH, *common],
            [*BEFORE_SFT, *sft],
            out / f"seed{seed}",
        )
        for variant in variants:
            changes = CHANGES[variant]
            overrides += [c for c in changes if not c.startswith("sft.")]
            sft_changes = [c.removeprefix("sft.") for c in changes if c.startswith("sft.")]
            if sft_changes:  # a warm start of its own, shared by the variants after it
                sft_overrides += sft_changes
                demo_dir = out / f"seed{seed}-{variant}"
            run_dir = demo_dir / f"grpo-{variant}"
            kept = [
                r
                for r in done
                if (r["seed"], r["variant"], r["overrides"], r["sft_overrides"])
                == (seed, variant, overrides, sft_overrides)
            ]
            if kept:
                print(f"[ablation] seed {seed}, {variant}: kept from {results}")
                rows.append(kept[-1])
                continue
            if variant not in only:
                continue
            summary = run_demo(
                demo_dir,
                seed=seed,
                backend=args.backend,
                train_overrides=[*overrides, f"trainer.run_dir={run_dir}"],
                sft_overrides=sft_overrides,
                reuse_sft=True,
            )
            if args.controls:
                summary |= run_controls(
                    demo_dir,
                    summary,
                    seed=seed,
                    backend=args.backend,
                    train_overrides=overrides,
                    sft_overrides=sft_overrides,
                    name=f"-{variant}",
                )
            rows.append(
                {
                    "seed": seed,
                    "variant": variant,
                    "overrides": overrides.copy(),
                    "sft_overrides": sft_overrides.copy(),
                    **summary,
                }
            )
            _save(results, rows, done)
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end"
    )
    table = markdown_table(rows, variants, args.seeds)
    (out / "results.md").write_text(f"{table}\n\nMachine: {machine}.\n")
    print(f"\n{table}\n\nMachine: {machine}.\nWritten to {out / 'results.md'} and {results}")


if __name__ == "__main__":
    main()
