"""Asynchronous RL against the synchronous trainer on the addition demo (no tools, #47 point 6).

The demo's own GRPO step (``tiny-cpu``: the tiny 4-layer model, 128 prompts x 2 samples, 3-digit
addition), from a random-weight model or the demo's warm start (``--model``), ``--steps`` steps a run, the synchronous and the asynchronous
trainer alternating, ``--rounds`` times; samples/s over the steps after the first two (start-up and
the async run's pipeline fill left out). The runs share the machine's cores:

- sync: the demo's layout, 2 FSDP2 workers (``trainer.num_workers=2``), generation and update in turn;
- async: η = 1, the actor on 1 worker and the rollout on 1 worker of its own, one thread each
  (``trainer.num_workers=1 trainer.rollout_workers=1 trainer.threads_per_worker=1``): the same two
  cores, one process on each, generating batch k + 1 while batch k trains.

There is little to hide: no tool waits, every response about as long as the next. The bound on
async/sync from the measured parts: the sync step G + T (generation, the rest) against an async
step of at least max(G_async, T_async), the rollout's generation of a batch and the trainer's busy
time a step, each on one core while the other side runs. With the default thread split instead
(``--async-layout demo``: the actor and the rollout on 2 workers each, 4 processes on 2 cores) the
two sides also contend for the cores.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_async_addition.py --rounds 2 --steps 25
    PYTHONPATH=. .venv/bin/python benchmarks/bench_async_addition.py --rounds 2 --steps 25 \
        --model runs/demo/sft/hf_model          # from the demo's warm start (make demo writes it)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

from bench_async import QUIET_RUN, alternate  # beside it in benchmarks/

from rl_extension.config import PPOConfig, load_config
from rl_extension.trainers.async_ppo import make_trainer
from rl_extension.trainers.metrics import read_jsonl

LAYOUTS = {
    "one-each": ["trainer.num_workers=1", "trainer.rollout_workers=1", "trainer.threads_per_worker=1"],
    "demo": [],  # the preset's: 2 workers for the actor, as many for the rollout
}
SKIP = 2  # steps left out at the start of each run


def run(mode: str, args: argparse.Namespace, run_dir: str) -> dict[str, float]:
    """One run: samples/s over the steps after the first ``SKIP``, and where its step went."""
    overrides = [
        f"trainer.run_dir={run_dir}",
        f"trainer.mode={mode}",
        f"trainer.total_steps={args.steps}",
        *QUIET_RUN,
    ]
    if args.model:  # the demo's step: groups whose samples all scored alike are left out of the update
        overrides += [f"model.path={args.model}"]
    else:  # a random model's groups all score 0: update them all
        overrides += ["algorithm.drop_uniform_groups=false"]
    if mode == "async":
        overrides += ["trainer.max_staleness=1", *LAYOUTS[args.async_layout]]
    with make_trainer(load_config(PPOConfig, "tiny-cpu", overrides)) as trainer:
        trainer.fit()
    records = read_jsonl(trainer.run_dir / "metrics.jsonl")[SKIP:]
    step = statistics.median(r["timing/step_s"] for r in records)
    samples = trainer.config.data.train_batch_size * trainer.config.rollout.n
    out = {
        "samples_per_s": samples * len(records) / sum(r["timing/step_s"] for r in records),
        "step_s": step,
    }
    if mode == "sync":
        out["gen_s"] = statistics.median(r["timing/gen_s"] for r in records)
        out["train_s"] = step - out["gen_s"]
    else:
        out["gen_s"] = statistics.median(r["async/generate_s"] for r in records)
        out["train_s"] = statistics.median(r["async/trainer_busy_frac"] * r["timing/step_s"] for r in records)
        out["staleness_max"] = max(r["async/staleness_max"] for r in records)
    return out


def bound(sync: dict[str, float], async_: dict[str, float]) -> tuple[float, str]:
    """The best async/sync these parts allow, with its arithmetic."""
    sync_step = sync["gen_s"] + sync["train_s"]
    async_step = max(async_["gen_s"], async_["train_s"])
    text = (
        f"(G {sync['gen_s']:.3f} + T {sync['train_s']:.3f} = {sync_step:.3f} s) / max(G_async "
        f"{async_['gen_s']:.3f}, T_async {async_['train_s']:.3f}) = {sync_step:.3f} / {async_step:.3f}"
    )
    return sync_step / async_step, text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="sync/async pairs, alternating")
    parser.add_argument(
        "--steps", type=int, default=12, help=f"steps of each run (the first {SKIP} left out)"
    )
    parser.add_argument("--async-layout", choices=sorted(LAYOUTS), default="one-each")
    parser.add_argument(
        "--model",
        default="",
        help="a warm start to train from (the demo's RUN/sft/hf_model: responses of the trained length); "
        "default: the preset's random tiny model, whose responses run to the token limit",
    )
    args = parser.parse_args(argv)
    if args.steps <= SKIP:
        parser.error(f"--steps must be more than {SKIP}, got {args.steps}")
    print(
        f"{platform.machine()}, {os.cpu_count()} cores; the addition demo's GRPO step (tiny-cpu, "
        f"{args.model or 'random weights'}); sync: 2 workers; async: max_staleness=1, layout {args.async_layout}",
        flush=True,
    )
    results = alternate(args.rounds, lambda mode, run_dir, _: run(mode, args, run_dir), bound)
    sync = statistics.median(r["samples_per_s"] for r in results["sync"])
    async_ = statistics.median(r["samples_per_s"] for r in results["async"])
    bounds = statistics.median(bound(s, a)[0] for s, a in zip(results["sync"], results["async"]))
    print(
        f"samples/s (median of {args.rounds}): sync {sync:.1f}, async {async_:.1f}, async/sync "
        f"{async_ / sync:.2f}x (bound from the measured parts {bounds:.2f}x); load average at the end "
        f"{os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
