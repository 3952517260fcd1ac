"""Plot a run's metrics.jsonl into one PNG of small panels (reward, accuracy, KL, entropy, ...).

    spmdcall-rl plot runs/tiny-cpu             # -> runs/tiny-cpu/plots/metrics.png
    python -m rl_extension.app.plot runs/tiny-cpu

An asynchronous run (trainer.mode=async) also gets its staleness, buffer and busy panels, drawn even
when flat (a constant staleness is a finding), and ``plot_timeline`` draws its timeline.jsonl: when
the rollout generated and when the trainer trained (plots/timeline.png).

Only panels whose metrics the run logged are drawn, so the same call works for GRPO, PPO and SFT runs.
A series that keeps one value for the whole run (a KL panel without a KL term, the clip fraction of
one on-policy epoch) says nothing and is left out; so is a panel left with none. The panels of what
drives the update (the supervised term's loss, the share of guided groups) appear when those are on.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from rl_extension.trainers.metrics import read_jsonl

__all__ = ["PANELS", "drawn_panels", "plot_run", "plot_timeline"]

# Panel title -> the metrics drawn in it.
PANELS: dict[str, list[str]] = {
    "held-out accuracy": ["val/accuracy"],
    "training reward": ["reward/score", "reward/accuracy"],
    "supervised term (actor.sft_loss_coef)": ["actor/sft_loss"],
    "guided groups (algorithm.guide_failed_groups)": ["guidance/guided_group_frac"],
    "KL": ["actor/ppo_kl", "actor/ref_kl", "actor/kl_loss", "actor/reward_kl_penalty"],
    "entropy": ["actor/entropy"],
    "clip fraction": ["actor/pg_clipfrac", "actor/pg_clipfrac_lower", "critic/vf_clipfrac"],
    "grad norm": ["actor/grad_norm", "critic/grad_norm", "sft/grad_norm"],
    "response length": ["response/length_mean", "val/response_length"],
    "tool use (multi-turn)": [
        "agent/tool_calls_per_traj",
        "agent/tool_error_rate",
        "val/agent/tool_calls_per_traj",
    ],
    "critic": ["critic/vf_loss", "critic/values_mean"],
    "SFT loss": ["sft/loss"],
    "seconds per step": ["timing/step_s", "timing/gen_s", "timing/update_actor_s", "timing/old_log_prob_s"],
    "tokens per second": ["perf/tokens_per_s"],
    "staleness (async; versions behind)": ["async/staleness_mean", "async/staleness_max"],
    "async: buffer and busy fractions": [
        "async/buffer_fill",
        "async/rollout_busy_frac",
        "async/trainer_busy_frac",
    ],
    "rollout ranks (async)": ["rollout/world_size", "rollout/ranks_lost", "rollout/ranks_joined"],
    "weight sync (async)": ["sync/changed_fraction", "sync/canary_gap"],
}

# Panels drawn whenever their metrics were logged, flat or not.
ALWAYS_DRAWN = {
    "staleness (async; versions behind)",
    "async: buffer and busy fractions",
    "rollout ranks (async)",
}


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> str:
    """Draw ``run_dir/metrics.jsonl`` into ``out`` (default ``run_dir/plots/metrics.png``); returns the path.

    Args:
        run_dir: a run directory (or the metrics.jsonl file itself).
        out: the PNG to write.

    Example:
        >>> plot_run("runs/tiny-cpu")  # doctest: +SKIP
        'runs/tiny-cpu/plots/metrics.png'
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    jsonl = run_dir if run_dir.suffix == ".jsonl" else run_dir / "metrics.jsonl"
    records = read_jsonl(jsonl)
    if not records:
        raise ValueError(f"no metrics in {jsonl}")
    panels = drawn_panels(records)
    cols = 3
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels.items()):
        for name, (steps, values) in series:
            ax.plot(steps, values, label=name, marker="o" if len(steps) < 30 else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(str(jsonl.parent.name))
    fig.tight_layout()
    out = Path(out) if out else jsonl.parent / "plots" / "metrics.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return str(out)


def plot_timeline(run_dir: str | Path, out: str | Path | None = None) -> str:
    """Draw an asynchronous run's ``timeline.jsonl`` (``out``, default ``run_dir/plots/timeline.png``):
    a lane for the trainer's steps and its waits for a batch, and one for the rollout's generate
    calls, or one for each batch generating at once (``trainer.rollout_batches_in_flight``); seconds
    since the first span; of a resumed run, the last session. Returns the path.

    Example:
        >>> plot_timeline("runs/tiny-cpu-async")  # doctest: +SKIP
        'runs/tiny-cpu-async/plots/timeline.png'
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    spans = read_jsonl(run_dir / "timeline.jsonl")
    starts = [i for i, s in enumerate(spans) if s["kind"] == "session"]
    spans = [s for s in spans[starts[-1] if starts else 0 :] if s["kind"] != "session"]  # the last session
    if not spans:
        raise ValueError(f"no spans in {run_dir / 'timeline.jsonl'} (is it a trainer.mode=async run?)")
    origin, end = min(s["start"] for s in spans), max(s["end"] for s in spans)
    generates = [s for s in spans if s["kind"] == "generate"]
    rows = dict(zip(map(id, generates), (1 + lane for lane in generate_lanes(generates))))
    count = max(rows.values(), default=1)
    colors = {
        "generate": "tab:blue",
        "train": "tab:orange",
        "wait": "lightgrey",
        "replace": "tab:red",
        "resize": "tab:green",
    }
    fig, ax = plt.subplots(figsize=(12, 2.0 + 0.6 * count))
    for s in spans:
        lane = rows.get(id(s), 1 if s["kind"] in ("replace", "resize") else 0)  # the rollout's lane
        width = s["end"] - s["start"]
        ax.broken_barh(
            [(s["start"] - origin, width)], (lane - 0.4, 0.8), color=colors[s["kind"]], edgecolor="white"
        )
        label = {
            "generate": f"b{s.get('batch')}\nv{s.get('version')}",
            "replace": "new\nrank",
            "resize": "resize",
        }.get(s["kind"], f"s{s.get('step', '')}")
        if s["kind"] != "wait" and width > 0.025 * (end - origin):
            ax.text(s["start"] + width / 2 - origin, lane, label, ha="center", va="center", fontsize=7)
    names = ["rollout"] if count == 1 else [f"rollout {i}" for i in range(1, count + 1)]
    ax.set_yticks(range(count + 1), ["trainer", *names])
    ax.set_xlabel(
        "seconds (rollout: batch b generated on policy version v, red: a dead rank replaced, green: resized; "
        "trainer: step s; grey: waiting)"
    )
    ax.set_title(f"{run_dir.name}: rollout and training")
    fig.tight_layout()
    out = Path(out) if out else run_dir / "plots" / "timeline.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return str(out)


def generate_lanes(spans: list[dict]) -> list[int]:
    """A lane for each of ``spans`` (``start``, ``end``) such that spans of one lane never overlap:
    each goes to the lowest lane free at its start (so batches generating at once get lanes of
    their own, and one batch's chunks, one after the other, share one)."""
    ends: list[float] = []  # the end of each lane's last span
    lanes = [0] * len(spans)
    for i in sorted(range(len(spans)), key=lambda i: spans[i]["start"]):
        free = [lane for lane, last in enumerate(ends) if last <= spans[i]["start"]]
        lanes[i] = free[0] if free else len(ends)
        if free:
            ends[lanes[i]] = spans[i]["end"]
        else:
            ends.append(spans[i]["end"])
    return lanes


def drawn_panels(records: list[dict]) -> dict[str, list[tuple[str, tuple[list[int], list[float]]]]]:
    """The panels :func:`plot_run` draws for these metrics records: title -> [(metric, (steps, values))],
    only the series that vary over the run."""
    panels = {title: [(name, _series(records, name)) for name in names] for title, names in PANELS.items()}
    panels = {
        title: [(n, s) for n, s in series if (s[1] if title in ALWAYS_DRAWN else _varies(s[1]))]
        for title, series in panels.items()
    }
    return {title: series for title, series in panels.items() if series}


def _varies(values: list[float]) -> bool:
    """Whether a series has points and more than one value (up to float noise)."""
    return bool(values) and max(values) - min(values) > 1e-9 * max(1.0, max(abs(v) for v in values))


def _series(records: list[dict], name: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[name]) for r in records if isinstance(r.get(name), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="spmdcall-rl plot", description="Plot a run's metrics.jsonl to PNG."
    )
    parser.add_argument("run_dir", help="the run directory (holding metrics.jsonl)")
    parser.add_argument("--out", default=None, help="the PNG to write (default RUN_DIR/plots/metrics.png)")
    args = parser.parse_args(argv)
    print(plot_run(args.run_dir, args.out))
    if (Path(args.run_dir) / "timeline.jsonl").exists():
        print(plot_timeline(args.run_dir))


if __name__ == "__main__":
    main()
