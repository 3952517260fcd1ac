"""Our GRPO trainer beside TRL's GRPOTrainer: same model, task, batch, learning rate and reward.

    python benchmarks/rl/compare_trl.py                          # seconds per step: 5 warm-up + 20 steps each
    python benchmarks/rl/compare_trl.py --repeats 3              # ours, trl, ours, trl, ...: pooled steps
    python benchmarks/rl/compare_trl.py --mode learn             # minutes to +30 points, at most 15 min a run
    python benchmarks/rl/compare_trl.py --model runs/sft/hf_model --engines trl
    python benchmarks/rl/compare_trl.py --engines 'ours,trl,ours@data.max_prompt_length=8'   # a variant of ours
    python benchmarks/rl/compare_trl.py --mode learn --prompts 128 --generations 2 \
        --engines 'ours@lr=1e-4,ours@lr=3e-4,ours@lr=1e-3,trl@lr=1e-4,trl@lr=3e-4,trl@lr=1e-3'   # an lr sweep
    python benchmarks/rl/compare_trl.py --precision bf16          # both engines in bf16 mixed precision
    python benchmarks/rl/compare_trl.py --from-json runs/bench-rl/speed-addition-hf.json      # redo the table
    make bench-rl                                                # both modes, installs the `bench` extra first

One invocation runs every engine of ``--engines``, each run in a process of its own
(``engines.py``), from one warm start: the tiny Qwen2 of ``rl_extension.models`` fine-tuned with
the demo's SFT preset (until its stop_at_accuracy on a dev split) at the size of ``WARM_START_MODEL``,
built once under ``--out`` and reused, or given with ``--model``.

- ``ours``: ``PPOTrainer`` on the tiny-cpu preset: ``--workers`` processes (process backend) with
  ``--threads / --workers`` torch threads each, actor (FSDP2) and HF rollout colocated.
- ``trl``: ``trl.GRPOTrainer`` in one process with ``--threads`` torch threads (``use_cpu``): the
  same model and tokenizer, no KL term (beta 0), one optimizer step per generation batch (on-policy,
  as ours), constant learning rate (``--lr-schedule cosine``: both decay alike over ``--max-steps``),
  token-mean ("dapo") loss, no logging, no evaluation of its own.

Both sample ``--prompts`` prompts x ``--generations`` responses per step at temperature 1 and reward
them with the task's scorer. Held-out accuracy is greedy exact match on the test split (256 prompts),
measured the same way for both (``rl_extension.roles.rollout.generate_responses`` + ``RewardManager``):
ours by its own validation, TRL's by a callback. Step times exclude validation.

``--mode speed`` reports the median seconds per step after ``--warmup`` steps; ``--mode learn``
trains until the held-out accuracy is ``--target-points`` above its start (or ``--max-minutes``
pass) and reports the training minutes (the steps' own time) to get there. ``--task`` and
``--rollout`` pick the task (``engines.TASKS``) and the rollout engine (ours: ``rollout.name``; TRL:
``hf`` is transformers generate, ``vllm`` its colocated vLLM), so a longer task or vLLM is a flag.
Results: ``--out``/<mode>-<task>-<rollout>.json and .md, with the load average sampled during each run;
learn mode also keeps each run's final model (``<run>/hf_model``), which ``score_models.py`` scores on
many more problems than the held-out split.

On a busy machine TRL's two OpenMP threads spin against each other and its steps take 10x longer;
``--omp-wait-policy passive`` (the default, for both engines) avoids that. Besides wall seconds, each
step's CPU seconds (all of an engine's processes) are reported: a load-independent view of the work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from engines import PRECISION, ROOT, TASKS, TRL_LR_SCHEDULES, TRL_ROLLOUT_ARGS, RunSpec

ENGINES = ("ours", "trl")
ENGINE_FILE = Path(__file__).with_name("engines.py")
MAX_SFT_ROUNDS = 3
# The model of every comparison in docs/rl/experiment-log.md: the demo's model (4 layers x 128, SFT at lr 2e-3
# in float32), pinned so that the published figures stay reproducible whatever the demo's presets
# become (--sft overrides come after these).
WARM_START_MODEL = [
    "model.tiny.num_layers=4",
    "model.tiny.hidden_size=128",
    "model.tiny.num_heads=4",
    "model.tiny.intermediate_size=512",
    "model.compute_dtype=float32",
    "model.attn_implementation=sdpa",
    "lr=2e-3",
]
MILESTONE_POINTS = (10, 20)  # learn mode also reports the time to these gains besides --target-points


def make_task_data(task: str, out: Path, seed: int = 0) -> dict[str, str]:
    """train (20000) / dev (256: SFT's early stop) / test (256: held out) parquet files of a task, split
    like ``rl_extension.app.cli.make_demo_data`` (the very same files for addition); reused if present."""
    import pyarrow.parquet as pq

    from rl_extension.data.prompts import make_task_splits

    num_train, num_dev, num_test = 20000, 256, 256
    files = {split: str(out / f"{split}.parquet") for split in ("train", "dev", "test")}
    if all(Path(f).exists() for f in files.values()):
        return files
    train_dev, test = make_task_splits(
        task, out / "all", num_train + num_dev, num_test, seed=seed, **TASKS[task].task_kwargs
    )
    table = pq.read_table(train_dev)
    pq.write_table(table.slice(0, num_train), files["train"])
    pq.write_table(table.slice(num_train), files["dev"])
    os.replace(test, files["test"])
    return files


def build_warm_start(
    task: str, data: dict[str, str], out: Path, seed: int, num_workers: int, overrides: list[str]
) -> str:
    """The demo's SFT warm start (preset sft-tiny-cpu plus ``overrides``), built once under ``out``.

    The tiny model learns the task in a sudden jump after a plateau that some seeds do not leave
    within the preset's 3000 steps; such a run is continued from its checkpoint (next seed, fresh
    optimizer) until the dev accuracy reaches ``stop_at_accuracy``, at most MAX_SFT_ROUNDS times.
    """
    from rl_extension.config import SFTConfig, load_config
    from rl_extension.models import build_tiny_model
    from rl_extension.trainers.sft import SFTTrainer

    done = out / "warm_start.txt"  # the final checkpoint's path, written once it is complete
    if done.exists():
        return done.read_text().strip()
    spec = TASKS[task]
    overrides = [*WARM_START_MODEL, *overrides]
    tiny = load_config(SFTConfig, "sft-tiny-cpu", [f"model.tiny.seed={seed}", *overrides]).model.tiny
    model_path = build_tiny_model(out / "tiny_model", **asdict(tiny))
    for r in range(MAX_SFT_ROUNDS):
        config = load_config(
            SFTConfig,
            "sft-tiny-cpu",
            [
                f"num_workers={num_workers}",
                f"data.train_files=[{data['train']}]",
                f"data.val_files=[{data['dev']}]",
                f"data.max_prompt_length={spec.max_prompt_length}",
                f"max_new_tokens={spec.max_new_tokens}",
                f"eval_scorer={spec.scorer}",
                *overrides,
                f"seed={seed + r}",
                f"model.path={model_path}",
                f"output_dir={out / f'sft-{r}'}",
            ],
        )
        print(
            f"[warm start] SFT round {r} on {task}: until {config.stop_at_accuracy:.0%} dev accuracy",
            flush=True,
        )
        with SFTTrainer(config) as sft:
            summary = sft.fit()
        model_path = str(summary["hf_model"])
        if summary.get("val/accuracy", 0.0) >= config.stop_at_accuracy:
            break
    else:
        print(
            f"[warm start] dev accuracy {summary.get('val/accuracy', 0.0):.3f} after {MAX_SFT_ROUNDS} rounds"
        )
    done.write_text(model_path)
    return model_path


def launch(spec: RunSpec, omp_wait_policy: str) -> dict[str, Any]:
    """Run one engine in a fresh process with its torch threads pinned; sample the load average meanwhile."""
    threads = spec.num_threads if spec.engine == "trl" else max(1, spec.num_threads // spec.num_workers)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        **({"OMP_WAIT_POLICY": omp_wait_policy.upper()} if omp_wait_policy != "unset" else {}),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    spec_file = Path(spec.result_file).with_suffix(".spec.json")
    spec_file.write_text(json.dumps(asdict(spec), indent=1))
    Path(spec.result_file).unlink(missing_ok=True)
    print(f"[{spec.engine}] {spec.mode}, seed {spec.seed}: {spec.run_dir}", flush=True)
    limit = 60 * spec.max_minutes + 600 if spec.mode == "learn" else 3600
    started, load = time.perf_counter(), [os.getloadavg()[0]]
    proc = subprocess.Popen([sys.executable, str(ENGINE_FILE), str(spec_file)], env=env, cwd=ROOT)
    try:
        while proc.poll() is None:
            if time.perf_counter() - started > limit:
                raise TimeoutError(f"the {spec.engine} run took more than {limit:.0f} s")
            time.sleep(2.0)
            load.append(os.getloadavg()[0])
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
    if proc.returncode != 0 or not Path(spec.result_file).exists():
        raise RuntimeError(f"the {spec.engine} run failed (exit {proc.returncode}); its output is above")
    result = json.loads(Path(spec.result_file).read_text())
    result["load_avg_1min"] = {"min": min(load), "mean": statistics.fmean(load), "max": max(load)}
    result["wall_s"] = time.perf_counter() - started
    return result


def summarize(rounds: list[dict[str, Any]], warmup: int, target_points: float) -> dict[str, Any]:
    """The figures of one engine over its rounds: step times after the warm-up (pooled), time to target."""
    timed = [s for r in rounds for s in r["steps"] if s["step"] > warmup]
    step_s = sorted(s["step_s"] for s in timed)
    loads = [r["load_avg_1min"] for r in rounds]
    summary: dict[str, Any] = {
        "rounds": len(rounds),
        "steps_timed": len(step_s),
        "step_s_median": _median(step_s),
        "step_s_p10": step_s[len(step_s) // 10] if step_s else None,
        "step_s_p90": step_s[(9 * len(step_s)) // 10] if step_s else None,
        "step_s_round_medians": [
            _median([s["step_s"] for s in r["steps"] if s["step"] > warmup]) for r in rounds
        ],
        "loop_s_median": _median([s["loop_s"] for s in timed]),
        "cpu_s_median": _median([s["cpu_s"] for s in timed]),
        "startup_s": _median([r["startup_s"] for r in rounds]),
        # Ours only: sampled tokens per second of the rollout call, and the mean response length.
        "gen_tokens_per_s_median": _median([s["gen_tokens_per_s"] for s in timed if "gen_tokens_per_s" in s]),
        "response_length_median": _median([s["response_length"] for s in timed if "response_length" in s]),
        "load_avg": f"{min(x['min'] for x in loads):.1f}–{max(x['max'] for x in loads):.1f} "
        f"(mean {statistics.fmean(x['mean'] for x in loads):.1f})",
        # Stages of most steps (the last step's checkpoint is no stage of a step).
        "stage_medians_s": {
            key: _median([s[key] for s in timed if key in s])
            for key in sorted({k for s in timed for k in s if k.startswith(("timing/", "cpu/"))})
            if 2 * sum(key in s for s in timed) > len(timed)
        },
    }
    if any(r["validations"] for r in rounds):
        summary |= {
            "accuracy_start": _median([r["validations"][0]["accuracy"] for r in rounds]),
            "accuracy_best": max(v["accuracy"] for r in rounds for v in r["validations"]),
            "stop_reasons": ", ".join(r["stop_reason"] for r in rounds),
            "train_minutes": [sum(s["step_s"] for s in r["steps"]) / 60 for r in rounds],
        }
        for points in sorted({*MILESTONE_POINTS, target_points}):
            hits = [_time_to_gain(r, points) for r in rounds]
            summary[f"steps_to_+{points:g}"] = _median_or_none([h and h[0] for h in hits])
            summary[f"minutes_to_+{points:g}"] = _median_or_none([h and h[1] for h in hits])
            summary[f"minutes_to_+{points:g}_rounds"] = [h and h[1] for h in hits]
    return summary


def _time_to_gain(result: dict[str, Any], points: float) -> tuple[int, float] | None:
    """(step, training minutes) of the first validation ``points`` above the first one; None if none.
    Training minutes are the steps' own seconds up to that step: validation and start-up excluded."""
    vals, steps = result["validations"], result["steps"]
    hit = next((v for v in vals if v["accuracy"] >= vals[0]["accuracy"] + points / 100 - 1e-9), None)
    if hit is None:
        return None
    return hit["step"], sum(s["step_s"] for s in steps if s["step"] <= hit["step"]) / 60


def markdown(report: dict[str, Any]) -> str:
    """The comparison table, one column per engine."""
    cfg, summaries = report["config"], {name: run["summary"] for name, run in report["runs"].items()}
    for s in summaries.values():  # "steps / minutes" cells
        for points in sorted({*MILESTONE_POINTS, cfg["target_points"]}):
            steps, minutes = s.get(f"steps_to_+{points:g}"), s.get(f"minutes_to_+{points:g}")
            s[f"to_+{points:g}"] = None if minutes is None else f"{steps:.0f} / {minutes:.1f}"
    label = {
        "ours": f"ours: {cfg['workers']} workers x {max(1, cfg['threads'] // cfg['workers'])} thread, process backend",
        "trl": f"TRL GRPOTrainer: 1 process x {cfg['threads']} threads",
    }
    label |= {
        name: f"{label[name.split('@')[0]]}, {', '.join(name.split('@')[1:])}"
        for name in summaries
        if "@" in name
    }

    def row(title: str, fmt: str, key: str) -> str:
        cells = [("—" if s.get(key) is None else fmt.format(s[key])) for s in summaries.values()]
        return f"| {title} | " + " | ".join(cells) + " |"

    lines = [
        f"{cfg['task']}, rollout {cfg['rollout']}, {cfg['prompts']} prompts x {cfg['generations']} samples per step, "
        f"lr {cfg['lr']:g} (unless a column names its own), {cfg.get('lr_schedule', 'constant')}, precision {cfg.get('precision', 'fp32')}; {report['machine']}",
        "",
        "| | " + " | ".join(label[name] for name in summaries) + " |",
        "|---|" + "---|" * len(summaries),
        row("rounds (runs of each engine, alternating)", "{}", "rounds"),
        row(f"s/step, median of the steps after {cfg['warmup']} warm-up steps", "{:.3f}", "step_s_median"),
        "| s/step, 10th / 90th percentile | "
        + " | ".join(
            "—" if s.get("step_s_p10") is None else f"{s['step_s_p10']:.3f} / {s['step_s_p90']:.3f}"
            for s in summaries.values()
        )
        + " |",  # no percentiles when a run ended within its warm-up steps
        row("s/step of the whole loop (data, logging), median", "{:.3f}", "loop_s_median"),
        row(
            "CPU s per step, all the engine's processes (less sensitive to load), median",
            "{:.3f}",
            "cpu_s_median",
        ),
        row("rollout: sampled tokens/s (all workers), median", "{:.0f}", "gen_tokens_per_s_median"),
        row("response length in tokens (mean of a step), median", "{:.1f}", "response_length_median"),
        row("start-up s (processes, models)", "{:.1f}", "startup_s"),
    ]
    if cfg["mode"] == "learn":
        lines += [
            row("held-out accuracy at the start", "{:.3f}", "accuracy_start"),
            *(
                row(f"steps / training minutes to +{points:g} points", "{}", f"to_+{points:g}")
                for points in sorted({*MILESTONE_POINTS, cfg["target_points"]})
            ),
            row("best held-out accuracy", "{:.3f}", "accuracy_best"),
            row("stopped by", "{}", "stop_reasons"),
        ]
    lines.append(row("load average (1 min) during the runs, 2 cores", "{}", "load_avg"))
    staged = {name: s["stage_medians_s"] for name, s in summaries.items() if s.get("stage_medians_s")}
    if staged:
        keys = sorted({key for stages in staged.values() for key in stages})
        lines += [
            "",
            "Ours, medians per step: wall seconds of each stage (timing/...; actor_update_worker_s is the "
            "update inside a worker) and CPU seconds of each group call (cpu/...: all workers, or the controller).",
            "",
            "| stage | " + " | ".join(staged) + " |",
            "|---|" + "---:|" * len(staged),
            *(
                f"| {key} | "
                + " | ".join(f"{stages[key]:.3f}" if key in stages else "—" for stages in staged.values())
                + " |"
                for key in keys
            ),
        ]
    return "\n".join(lines) + "\n"


def parse_engine(engine: str, default_lr: float) -> tuple[str, float, list[str]]:
    """``ours``, ``trl``, ``ENGINE@lr=VALUE`` or ``ours@KEY=VALUE[@KEY=VALUE]`` -> (engine, lr, PPOConfig overrides).

    Example:
        >>> parse_engine("trl@lr=3e-4", 5e-5)
        ('trl', 0.0003, [])
    """
    kind, *items = engine.split("@")
    lrs = [float(o.removeprefix("lr=")) for o in items if o.startswith("lr=")]
    overrides = [o for o in items if not o.startswith("lr=")]
    if kind not in ENGINES or (overrides and kind != "ours") or not all("=" in o for o in items):
        raise ValueError(f"{engine!r} is not ours, trl, ENGINE@lr=VALUE or ours@KEY=VALUE[@KEY=VALUE]")
    return kind, lrs[-1] if lrs else default_lr, overrides


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _median_or_none(values: list[float | None]) -> float | None:
    """The median if every round has a value (a round that missed the target makes it None)."""
    return None if any(v is None for v in values) else _median(values)  # type: ignore[arg-type]


def rewrite_report(path: Path) -> int:
    """Summarize the rounds of a results JSON again (after a change to the summaries) and rewrite the table."""
    report = json.loads(path.read_text())
    cfg = report["config"]
    for run in report["runs"].values():
        run["summary"] = summarize(run["rounds"], cfg["warmup"], cfg["target_points"])
    path.write_text(json.dumps(report, indent=1))
    table = markdown(report)
    path.with_suffix(".md").write_text(table)
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("speed", "learn"), default="speed")
    parser.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help="comma-separated: ours, trl; ours@KEY=VALUE[@KEY=VALUE] is ours with more PPOConfig overrides; "
        "ENGINE@lr=VALUE (ours or trl) replaces --lr for that engine",
    )
    parser.add_argument("--task", choices=sorted(TASKS), default="addition")
    parser.add_argument("--rollout", choices=sorted(TRL_ROLLOUT_ARGS), default="hf")
    parser.add_argument(
        "--precision",
        choices=sorted(PRECISION),
        default="fp32",
        help="both engines: fp32, or bf16 mixed precision (float32 weights, bfloat16 matmuls, eager attention)",
    )
    parser.add_argument("--model", default="", help="warm-start HF checkpoint (default: build one by SFT)")
    parser.add_argument("--out", default="runs/bench-rl", help="data, warm start, runs and results")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every engine, alternating")
    parser.add_argument("--steps", type=int, default=20, help="speed: timed steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the step-time statistics")
    parser.add_argument("--val-every", type=int, default=10, help="learn: validate every this many steps")
    parser.add_argument("--target-points", type=float, default=30.0, help="learn: accuracy gain to reach")
    parser.add_argument("--max-minutes", type=float, default=15.0, help="learn: wall-time cap of each run")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="learn: step cap of each run (0: none); on a busy machine a step cap keeps the curves comparable",
    )
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument(
        "--lr-schedule",
        choices=sorted(TRL_LR_SCHEDULES),
        default="constant",
        help="both engines: constant, or cosine decay to 0.1 x lr over each run's steps (--max-steps)",
    )
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="samples per prompt")
    parser.add_argument("--workers", type=int, default=2, help="ours: worker processes")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each engine in all")
    parser.add_argument(
        "--omp-wait-policy",
        choices=("passive", "active", "unset"),
        default="passive",
        help="OMP_WAIT_POLICY of both engines: passive keeps TRL's 2 OpenMP threads from spinning against "
        "each other on a busy machine (10x slower steps there); unset leaves the environment's",
    )
    parser.add_argument("--seed", type=int, default=0, help="round r of learn mode uses seed + r")
    parser.add_argument(
        "--data-seed",
        type=int,
        default=0,
        help="seed of the problems (train/dev/test); 0, the demo's: its problems are the same for every --seed",
    )
    parser.add_argument("--ours", action="append", default=[], metavar="KEY=VALUE", help="PPOConfig override")
    parser.add_argument("--sft", action="append", default=[], metavar="KEY=VALUE", help="SFTConfig override")
    parser.add_argument(
        "--from-json", metavar="FILE", help="only rebuild the summaries and table of a results JSON"
    )
    args = parser.parse_args(argv)
    if args.from_json:
        return rewrite_report(Path(args.from_json))
    if args.lr_schedule != "constant" and not (args.mode == "speed" or args.max_steps):
        parser.error(f"--lr-schedule {args.lr_schedule} needs --max-steps: the steps it decays over")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for engine in engines:
        try:
            parse_engine(engine, args.lr)
        except ValueError as exc:
            parser.error(f"--engines: {exc}")

    out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
    tag = f"{args.mode}-{args.task}-{args.rollout}" + (
        "" if args.precision == "fp32" else f"-{args.precision}"
    )
    if engines != list(ENGINES):
        tag += "-" + "-".join(_slug(e) for e in engines)
    (out / tag).mkdir(parents=True, exist_ok=True)
    data = make_task_data(args.task, out / "data" / args.task, seed=args.data_seed)
    model = args.model or build_warm_start(
        args.task, data, out / f"warm_start-{args.task}", args.seed, args.workers, args.sft
    )
    base = RunSpec(
        engine="",
        mode=args.mode,
        model=str(Path(model).resolve()),
        train_file=data["train"],
        test_file=data["test"],
        task=args.task,
        rollout=args.rollout,
        run_dir="",
        result_file="",
        num_steps=args.warmup + args.steps if args.mode == "speed" else (args.max_steps or 1_000_000),
        val_every=args.val_every,
        target_points=args.target_points,
        max_minutes=args.max_minutes,
        lr=args.lr,
        lr_schedule=args.lr_schedule,
        num_prompts=args.prompts,
        num_generations=args.generations,
        num_workers=args.workers,
        num_threads=args.threads,
        seed=args.seed,
        precision=args.precision,
        ours_overrides=args.ours,
    )
    rounds: dict[str, list[dict[str, Any]]] = {engine: [] for engine in engines}
    for r in range(args.repeats):
        for engine in engines:
            name, (kind, lr, overrides) = f"{_slug(engine)}-{r}", parse_engine(engine, args.lr)
            spec = replace(
                base,
                engine=kind,
                lr=lr,
                ours_overrides=[*args.ours, *overrides],
                run_dir=str(out / tag / name),
                result_file=str(out / tag / f"{name}.result.json"),
                seed=args.seed + r if args.mode == "learn" else args.seed,
            )
            rounds[engine].append(launch(spec, args.omp_wait_policy))

    import torch
    import transformers

    wait_policy = args.omp_wait_policy.upper()
    if args.omp_wait_policy == "unset":
        wait_policy = os.environ.get("OMP_WAIT_POLICY", "unset")

    report = {
        "config": {k: v for k, v in vars(args).items() if k not in ("ours", "sft")}
        | {"model": model, "ours_overrides": args.ours},
        "machine": f"{os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
        + (f", trl {rounds['trl'][0]['trl_version']}" if "trl" in rounds else "")
        + f", OMP_WAIT_POLICY={wait_policy}",
        "runs": {
            engine: {"summary": summarize(results, args.warmup, args.target_points), "rounds": results}
            for engine, results in rounds.items()
        },
    }
    (out / f"{tag}.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (out / f"{tag}.md").write_text(table)
    print(f"\n{table}\nwritten: {out / f'{tag}.json'}, {out / f'{tag}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
