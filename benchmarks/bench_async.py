"""Asynchronous RL against the synchronous trainer (#47): trained samples per second on the calc agent
task with a tool whose latency has a long tail.

Each step is 16 prompts x 8 samples = 128 trajectories of up to 3 turns (calc-cpu preset, the tiny
4-layer model, process backend). Every turn calls ``slow_calc``, which answers after a lognormal
delay (median 0.3 s, sigma 1: a mean of 0.49 s, 1 call in 20 over 1.6 s), so a synchronous step
waits for its slowest trajectory. The same run is made with ``trainer.mode=sync`` and with
``trainer.mode=async`` (``--max-staleness``, default 1), alternating, ``--rounds`` times; samples/s
is 128 x (steps - 1) over the seconds of the steps after the first (start-up and the first step,
which pays for the first generation in both modes, left out).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_async.py                 # 1 round, 4 steps each
    PYTHONPATH=. .venv/bin/python benchmarks/bench_async.py --rounds 3 --steps 5   # docs/rl/async.md
    PYTHONPATH=. .venv/bin/python benchmarks/bench_async.py --rounds 2 --steps 6 --max-staleness 2

A random model writes no calls of its own, so every turn is read as a call (the ``bench_calls``
format below): what this measures is the loop's overlap, not the model's skill.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import numpy as np

from rl_extension.agents import ToolCall, ToolCallFormat, register_tool_format, tool
from rl_extension.async_trainer import make_trainer
from rl_extension.config import PPOConfig, load_config
from rl_extension.metrics import read_jsonl

PROMPTS, SAMPLES, MAX_TURNS = 16, 8, 3
MEDIAN_S, SIGMA = 0.3, 1.0
_latency = [np.random.default_rng(0)]  # reseeded per run: a round's two runs draw the same delays


@tool(name="slow_calc", description="calc behind a link with a long tail: lognormal latency.")
async def slow_calc(expression: str) -> str:
    await asyncio.sleep(float(_latency[0].lognormal(np.log(MEDIAN_S), SIGMA)))
    return "0"


@register_tool_format("bench_calls")
class EveryTurnCalls(ToolCallFormat):
    """Every turn is a call of ``slow_calc`` with the turn's text."""

    def parse(self, text, tools):
        return [ToolCall("slow_calc", {"expression": text})]

    def render_call(self, name, arguments):
        return arguments["expression"]

    def observation(self, results):
        return "".join(f"<result>{r}</result>" for r in results)


def run(mode: str, steps: int, max_staleness: int, run_dir: str, seed: int) -> dict[str, float]:
    """One run; its samples/s over the steps after the first, and its staleness."""
    _latency[0] = np.random.default_rng(seed)
    overrides = [
        f"trainer.run_dir={run_dir}",
        f"trainer.mode={mode}",
        f"trainer.total_steps={steps}",
        f"data.train_batch_size={PROMPTS}",
        f"rollout.n={SAMPLES}",
        f"rollout.multi_turn.max_turns={MAX_TURNS}",
        "rollout.multi_turn.tools=[slow_calc]",
        "rollout.multi_turn.format=bench_calls",
        "rollout.multi_turn.max_tokens_per_turn=8",
        "rollout.max_new_tokens=48",
        "algorithm.drop_uniform_groups=false",  # a random model's groups all score 0: update them all
        "trainer.num_workers=1",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        "trainer.save_every=0",
        "trainer.save_hf_model=false",
        "trainer.loggers=[jsonl]",
        "trainer.progress=none",
    ]
    if mode == "async":
        overrides += [f"trainer.max_staleness={max_staleness}"]  # new weights apply from the next turn
    start = time.perf_counter()
    with make_trainer(load_config(PPOConfig, "calc-cpu", overrides)) as trainer:
        trainer.fit()
    records = read_jsonl(trainer.run_dir / "metrics.jsonl")[1:]
    seconds = sum(r["timing/step_s"] for r in records)
    return {
        "samples_per_s": PROMPTS * SAMPLES * len(records) / seconds,
        "step_s": statistics.median(r["timing/step_s"] for r in records),
        "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in records),
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in records),
        "tool_calls_per_traj": statistics.mean(r["agent/tool_calls_per_traj"] for r in records),
        "wall_s": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="sync/async pairs, alternating")
    parser.add_argument("--steps", type=int, default=4, help="steps of each run (the first is left out)")
    parser.add_argument("--max-staleness", type=int, default=1, help="the async runs' trainer.max_staleness")
    args = parser.parse_args(argv)
    print(
        f"{PROMPTS * SAMPLES} trajectories a step, up to {MAX_TURNS} turns, tool latency lognormal "
        f"(median {MEDIAN_S} s, sigma {SIGMA}); async bound: max_staleness={args.max_staleness} "
        f"(a sample of version v trains at version <= v + {args.max_staleness})",
        flush=True,
    )
    results: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = ("sync", "async") if round_ % 2 == 0 else ("async", "sync")
            for mode in order:
                result = run(mode, args.steps, args.max_staleness, f"{tmp}/{mode}{round_}", seed=round_)
                results[mode].append(result)
                print(
                    f"round {round_} {mode:5s}: " + ", ".join(f"{k} {v:.3g}" for k, v in result.items()),
                    flush=True,
                )
    sync = statistics.median(r["samples_per_s"] for r in results["sync"])
    async_ = statistics.median(r["samples_per_s"] for r in results["async"])
    print(
        f"samples/s (median of {args.rounds}): sync {sync:.2f}, async {async_:.2f}, "
        f"async/sync {async_ / sync:.2f}x; async staleness max "
        f"{max(r['staleness_max'] for r in results['async']):.0f} (bound {args.max_staleness})"
    )


if __name__ == "__main__":
    main()
