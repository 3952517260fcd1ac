"""Score finished models on many fresh problems, side by side: is one really ahead of another?

The demo's held-out split has 256 problems: two models that both miss 3 of them are level there,
and one problem is 0.4 points. This scores Hugging Face checkpoints (ours' ``hf_model``, TRL's, a
warm start) on ``--num-problems`` problems that none of the demo's splits holds (the next problems
of the demo's own stream: its train, dev and test splits are the stream's first 20512), greedy
exact match as the trainer validates, and compares each pair on the same problems.

    python benchmarks/rl/score_models.py ours=runs/demo-seeds/seed2/grpo/hf_model \\
        trl=runs/bench-rl/learn-addition-hf-trl_lr_3e_4/trl_lr_3e_4-0/hf_model --num-problems 4096

Prints, for each model, the accuracy with its 95% Wilson interval and, for each pair, the problems
only one of the two gets right and the exact two-sided sign (McNemar) test of those; writes the
same as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # engines.py beside this file

from engines import TASKS, greedy_scorer  # noqa: E402

# The demo's splits (rl_extension.app.demo.make_demo_data): the first 20000 + 256 + 256 problems of the
# stream drawn with seed 0; fresh problems are the ones after them.
DEMO_PROBLEMS = 20000 + 256 + 256


def fresh_problems(out_dir: Path, num_problems: int, task: str = "addition", seed: int = 0) -> str:
    """``num_problems`` distinct problems of ``task`` that follow the demo's splits in its stream,
    written to ``out_dir/test.parquet`` (the path is returned)."""
    from rl_extension.data.prompts import make_task_splits

    _, fresh = make_task_splits(
        task, out_dir, DEMO_PROBLEMS, num_problems, seed=seed, **TASKS[task].task_kwargs
    )
    return fresh


def wilson_interval(right: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion.

    Example:
        >>> [round(x, 3) for x in wilson_interval(253, 256)]
        [0.966, 0.996]
    """
    if total <= 0:
        raise ValueError(f"total must be > 0, got {total}")
    p = right / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return centre - half, centre + half


def sign_test_p(only_a: int, only_b: int) -> float:
    """Exact two-sided p-value of McNemar's test: of the problems only one model gets right, how
    likely a split at least this uneven is if each is equally likely to be the one.

    Example:
        >>> sign_test_p(0, 0), round(sign_test_p(10, 2), 4)
        (1.0, 0.0386)
    """
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def compare(scores: dict[str, list[float]]) -> dict[str, Any]:
    """Per model: right, total, accuracy, its interval; per pair (in the order given): who alone is right."""
    models = {}
    for name, s in scores.items():
        right = int(sum(x == 1.0 for x in s))
        low, high = wilson_interval(right, len(s))
        models[name] = {"right": right, "total": len(s), "accuracy": right / len(s), "ci95": [low, high]}
    names, pairs = list(scores), []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            only_a = sum(x == 1.0 and y != 1.0 for x, y in zip(scores[a], scores[b]))
            only_b = sum(y == 1.0 and x != 1.0 for x, y in zip(scores[a], scores[b]))
            pairs.append(
                {"a": a, "b": b, "only_a": only_a, "only_b": only_b, "p": sign_test_p(only_a, only_b)}
            )
    return {"models": models, "pairs": pairs}


def markdown(report: dict[str, Any]) -> str:
    """The two tables of a ``compare`` report."""
    lines = ["| model | right | accuracy | 95% interval |", "|---|---:|---:|---:|"]
    for name, m in report["models"].items():
        low, high = m["ci95"]
        lines.append(
            f"| {name} | {m['right']} / {m['total']} | {100 * m['accuracy']:.2f}% | "
            f"{100 * low:.1f}–{100 * high:.1f}% |"
        )
    lines += ["", "| a | b | only a right | only b right | a − b (points) | p (two-sided sign test) |"]
    lines.append("|---|---|---:|---:|---:|---:|")
    models = report["models"]
    for p in report["pairs"]:
        diff = 100 * (models[p["a"]]["accuracy"] - models[p["b"]]["accuracy"])
        pvalue = f"{p['p']:.3g}" if p["p"] > 0 else "< 1e-300"  # smaller than a float holds
        lines.append(f"| {p['a']} | {p['b']} | {p['only_a']} | {p['only_b']} | {diff:+.2f} | {pvalue} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "models", nargs="+", metavar="NAME=PATH", help="a Hugging Face checkpoint and its label"
    )
    parser.add_argument("--num-problems", type=int, default=4096)
    parser.add_argument("--task", choices=sorted(TASKS), default="addition")
    parser.add_argument(
        "--data-dir", default="runs/score-models", help="where the fresh problems are written"
    )
    parser.add_argument("--out", default="", help="a JSON file for the report (and .md beside it)")
    args = parser.parse_args(argv)
    if args.num_problems < 1:
        parser.error(f"--num-problems must be >= 1, got {args.num_problems}")
    paths = {}
    for item in args.models:
        name, sep, path = item.partition("=")
        if not sep or not name or not Path(path, "config.json").is_file():
            parser.error(f"{item!r} is not NAME=PATH with a Hugging Face checkpoint (config.json) at PATH")
        paths[name] = path

    import torch
    from transformers import AutoModelForCausalLM

    from rl_extension.models import load_tokenizer

    problems = fresh_problems(
        Path(args.data_dir) / f"{args.task}-{args.num_problems}", args.num_problems, args.task
    )
    scores: dict[str, list[float]] = {}
    for name, path in paths.items():
        score = greedy_scorer(problems, args.task, load_tokenizer(path))  # each with its own tokenizer
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        scores[name] = score(model).tolist()
        print(
            f"{name}: {sum(x == 1.0 for x in scores[name])} / {len(scores[name])} right ({path})", flush=True
        )
    report = compare(scores) | {"problems": problems, "paths": paths}
    table = markdown(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        Path(args.out).with_suffix(".md").write_text(table)
    print(f"\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
