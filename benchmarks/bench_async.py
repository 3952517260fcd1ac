"""Asynchronous RL against the synchronous trainer (#47): trained samples per second on the calc agent
task with a tool whose latency has a long tail.

Each step is 16 prompts x 8 samples = 128 trajectories of up to 3 turns (calc-cpu preset, the tiny
4-layer model, process backend). Every turn calls ``slow_calc``, which answers after a lognormal
delay (median 0.3 s, sigma 1: a mean of 0.49 s, 1 call in 20 over 1.6 s), so a synchronous step
waits for its slowest trajectory. The same run is made with ``trainer.mode=sync`` and with
``trainer.mode=async`` (``--max-staleness``, default 1), alternating, ``--rounds`` times; samples/s
is 128 x (steps - 1) over the seconds of the steps after the first (start-up and the first step,
which pays for the first generation in both modes, left out). The async run's first step also
starts the next batches (up to ``--rollout-batches-in-flight``), so in a short run the steps after
it draw on a head start: ``samples_per_s_all`` counts every step, the first included, and the
summary prints both ratios.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_async.py                 # 1 round, 4 steps each
    PYTHONPATH=. .venv/bin/python benchmarks/bench_async.py --rounds 3 --steps 5   # docs/rl/async.md
    PYTHONPATH=. .venv/bin/python benchmarks/bench_async.py --rounds 2 --steps 5 --max-staleness 2 \
        --rollout-batches-in-flight 2                                   # two batches generating at once
    PYTHONPATH=. .venv/bin/python benchmarks/bench_async.py --threads-per-worker 0 ...  # cores divided

By default every process has one thread in both modes (``--threads-per-worker 1``), so the ratio
measures the overlap, not the thread count; ``--threads-per-worker 0`` divides the machine's cores
among the run's processes (the sync run's one worker 2 threads on 2 cores, the async run's actor and
rollout 1 each), where a loaded machine makes the sync run's two threads contend (6-10x slower
steps measured at load 10-19), so that ratio is not like for like.

Each run also reports where its step goes. Sync: ``gen_s`` (G, generation), of it ``engine_s`` (C,
seconds with a ``generate_turns`` call in flight: the model's compute and the calls' overhead) and
``tool_wait_s`` (G - C: every trajectory waiting on its tool), and ``train_s`` (T, the rest of the
step). Async: ``train_s`` (T_async: the trainer busy, while generation competes for the cores),
``engine_s`` (C_async, the engine busy a step) and ``batch_gen_s`` (a batch's generation, start to
end). From these the summary prints the bound on async/sync: with m batches in flight the async step
is at best max(T_async, C_async, batch_gen_s / m), against the sync step G + T.

A random model writes no calls of its own, so every turn is read as a call (the ``bench_calls``
format below): what this measures is the loop's overlap, not the model's skill.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rl_extension.agents import ToolCall, ToolCallFormat, register_tool_format, tool
from rl_extension.config import PPOConfig, load_config
from rl_extension.trainers.async_ppo import make_trainer
from rl_extension.trainers.metrics import read_jsonl

PROMPTS, SAMPLES, MAX_TURNS = 16, 8, 3
MEDIAN_S, SIGMA = 0.3, 1.0
TOKENS_PER_TURN = 16  # a turn's 8 tokens and its observation: the response budget is this x max turns
# The tool's delays: reseeded per run (a round's two runs draw the same delays); --tool-median-s sets the median.
_latency: dict[str, Any] = {"rng": np.random.default_rng(0), "median_s": MEDIAN_S}


@tool(name="slow_calc", description="calc behind a link with a long tail: lognormal latency.")
async def slow_calc(expression: str) -> str:
    await asyncio.sleep(float(_latency["rng"].lognormal(np.log(_latency["median_s"]), SIGMA)))
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


class EngineClock:
    """The spans during which at least one ``generate_turns`` call of the agent loops is in flight
    (wall time, ``time.time()``): the rollout engine busy, as the controller sees it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._in_flight, self._since = 0, 0.0
        self.spans: list[tuple[float, float]] = []

    def watch(self, agent: Any) -> None:
        """Time every call of ``agent``'s turn client (a benchmark's instrument: it wraps the client's
        private submit callable)."""
        submit = agent.client._submit

        async def timed(requests):
            self._enter()
            try:
                return await submit(requests)
            finally:
                self._leave()

        agent.client._submit = timed

    def _enter(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._since = time.time()
            self._in_flight += 1

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.spans.append((self._since, time.time()))

    def busy_s(self, start: float, end: float) -> float:
        return sum(max(0.0, min(e, end) - max(s, start)) for s, e in self.spans)


# A benchmark run: no validation, no checkpoint, metrics to metrics.jsonl only, no progress bar.
QUIET_RUN = [
    "trainer.val_every=0",
    "trainer.val_before_train=false",
    "trainer.save_every=0",
    "trainer.save_hf_model=false",
    "trainer.loggers=[jsonl]",
    "trainer.progress=none",
]


def run(mode: str, args: argparse.Namespace, run_dir: str, seed: int) -> dict[str, float]:
    """One run; its samples/s over the steps after the first, its staleness and where its steps went."""
    _latency["rng"] = np.random.default_rng(seed)
    overrides = [
        f"trainer.run_dir={run_dir}",
        f"trainer.mode={mode}",
        f"trainer.total_steps={args.steps}",
        f"data.train_batch_size={PROMPTS}",
        f"rollout.n={SAMPLES}",
        f"rollout.multi_turn.max_turns={args.max_turns}",
        "rollout.multi_turn.tools=[slow_calc]",
        "rollout.multi_turn.format=bench_calls",
        "rollout.multi_turn.max_tokens_per_turn=8",
        f"rollout.max_new_tokens={TOKENS_PER_TURN * args.max_turns}",
        "algorithm.drop_uniform_groups=false",  # a random model's groups all score 0: update them all
        "trainer.num_workers=1",
        f"trainer.threads_per_worker={args.threads_per_worker}",
        *QUIET_RUN,
    ]
    if mode == "async":
        overrides += [f"trainer.max_staleness={args.max_staleness}"]  # new weights: from the next turn
        in_flight = args.rollout_batches_in_flight
        if in_flight != 1:  # a batch being generated holds a slot of the buffer
            overrides += [
                f"trainer.rollout_batches_in_flight={in_flight}",
                f"trainer.buffer_size={max(2, in_flight)}",
            ]
    start, clock = time.perf_counter(), EngineClock()
    with make_trainer(load_config(PPOConfig, "calc-cpu", overrides)) as trainer:
        for agent in trainer.producer_agents if mode == "async" else [trainer.agent]:
            clock.watch(agent)
        trainer.fit()
    everything = read_jsonl(trainer.run_dir / "metrics.jsonl")
    records = everything[1:]
    seconds = sum(r["timing/step_s"] for r in records)
    mean = statistics.mean
    return {
        "samples_per_s": PROMPTS * SAMPLES * len(records) / seconds,
        # every step, the first too: an async run's first step also fills its pipeline (up to
        # rollout_batches_in_flight batches), which the steps after it then draw on
        "samples_per_s_all": PROMPTS
        * SAMPLES
        * len(everything)
        / sum(r["timing/step_s"] for r in everything),
        "step_s": statistics.median(r["timing/step_s"] for r in records),
        "mean_step_s": seconds / len(records),
        **step_parts(mode, everything, clock),
        "staleness_mean": mean(r.get("async/staleness_mean", 0.0) for r in records),
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in records),
        "tool_calls_per_traj": mean(r["agent/tool_calls_per_traj"] for r in records),
        "wall_s": time.perf_counter() - start,
    }


def step_parts(mode: str, everything: list[dict], clock: EngineClock) -> dict[str, float]:
    """Where a step after the first went, on average: sync G (``gen_s``) = C (``engine_s``) + tool
    wait, and T (``train_s``); async the trainer's wait, C_async, T_async, a batch's generation."""
    records, mean = everything[1:], statistics.mean
    gen_s = mean(r["timing/gen_s"] for r in records)  # async: the trainer's wait for its batch
    engine_s = clock.busy_s(everything[0]["time"], everything[-1]["time"]) / len(records)
    train_s = mean(r["timing/step_s"] - r["timing/gen_s"] for r in records)
    if mode == "sync":
        return {"gen_s": gen_s, "engine_s": engine_s, "tool_wait_s": gen_s - engine_s, "train_s": train_s}
    return {
        "wait_s": gen_s,
        "engine_s": engine_s,
        "train_s": train_s,
        "batch_gen_s": mean(r["async/generate_s"] for r in records),
        "rollout_busy": mean(r["async/rollout_busy_frac"] for r in records),
        "trainer_busy": mean(r["async/trainer_busy_frac"] for r in records),
    }


def bound(sync: dict[str, float], async_: dict[str, float], in_flight: int) -> tuple[float, str]:
    """The best async/sync these parts allow: the sync step G + T against an async step of at least
    max(T_async, C_async, batch_gen_s / m), with its arithmetic."""
    sync_step = sync["gen_s"] + sync["train_s"]
    limits = {
        "T_async": async_["train_s"],
        "C_async": async_["engine_s"],
        f"batch_gen/{in_flight}": async_["batch_gen_s"] / in_flight,
    }
    name, step = max(limits.items(), key=lambda item: item[1])
    text = (
        f"(G {sync['gen_s']:.2f} + T {sync['train_s']:.2f} = {sync_step:.2f} s) / max("
        + ", ".join(f"{k} {v:.2f}" for k, v in limits.items())
        + f") = {sync_step:.2f} / {step:.2f} ({name})"
    )
    return sync_step / step, text


def alternate(
    rounds: int,
    run_one: Callable[[str, str, int], dict[str, float]],
    bound_of: Callable[[dict[str, float], dict[str, float]], tuple[float, str]],
) -> dict[str, list[dict[str, float]]]:
    """``rounds`` sync/async pairs of ``run_one(mode, run_dir, round)``, sync first in even rounds,
    async first in odd ones (a drift of the machine falls on both alike); prints each run's result
    and each round's bound (``bound_of(sync, async)``: the ratio and its arithmetic) as they come."""
    results: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(rounds):
            for mode in ("sync", "async") if round_ % 2 == 0 else ("async", "sync"):
                results[mode].append(run_one(mode, f"{tmp}/{mode}{round_}", round_))
                print(
                    f"round {round_} {mode:5s}: "
                    + ", ".join(f"{k} {v:.3g}" for k, v in results[mode][-1].items()),
                    flush=True,
                )
            ratio, arithmetic = bound_of(results["sync"][-1], results["async"][-1])
            print(f"round {round_} bound on async/sync: {arithmetic} = {ratio:.2f}x", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="sync/async pairs, alternating")
    parser.add_argument("--steps", type=int, default=4, help="steps of each run (the first is left out)")
    parser.add_argument("--max-staleness", type=int, default=1, help="the async runs' trainer.max_staleness")
    parser.add_argument(
        "--rollout-batches-in-flight",
        type=int,
        default=1,
        help="the async runs' trainer.rollout_batches_in_flight (<= --max-staleness + 1)",
    )
    parser.add_argument(
        "--threads-per-worker",
        type=int,
        default=1,
        help="trainer.threads_per_worker of both runs (default 1: one thread each in both modes, like for "
        "like); 0: the cores divided among the processes (sync: "
        "2 threads in its one worker; async: 1 in each of its two), 1: one thread each in both",
    )
    parser.add_argument("--tool-median-s", type=float, default=MEDIAN_S, help="the tool's median latency")
    parser.add_argument("--max-turns", type=int, default=MAX_TURNS, help="turns of a trajectory at most")
    args = parser.parse_args(argv)
    _latency["median_s"] = args.tool_median_s
    m = args.rollout_batches_in_flight
    print(
        f"{PROMPTS * SAMPLES} trajectories a step, up to {args.max_turns} turns, tool latency lognormal "
        f"(median {args.tool_median_s} s, sigma {SIGMA}); async: max_staleness={args.max_staleness} "
        f"(a sample of version v trains at version <= v + {args.max_staleness}), "
        f"rollout_batches_in_flight={m}, threads_per_worker={args.threads_per_worker}",
        flush=True,
    )
    results = alternate(
        args.rounds,
        lambda mode, run_dir, round_: run(mode, args, run_dir, seed=round_),
        lambda sync, async_: bound(sync, async_, m),
    )
    sync = statistics.median(r["samples_per_s"] for r in results["sync"])
    async_ = statistics.median(r["samples_per_s"] for r in results["async"])
    bounds = [bound(s, a, m)[0] for s, a in zip(results["sync"], results["async"])]
    sync_all = statistics.median(r["samples_per_s_all"] for r in results["sync"])
    async_all = statistics.median(r["samples_per_s_all"] for r in results["async"])
    print(
        f"samples/s over every step, the first included (median of {args.rounds}): sync {sync_all:.2f}, "
        f"async {async_all:.2f}, async/sync {async_all / sync_all:.2f}x"
    )
    print(
        f"samples/s (median of {args.rounds}): sync {sync:.2f}, async {async_:.2f}, "
        f"async/sync {async_ / sync:.2f}x (bound from the measured parts {statistics.median(bounds):.2f}x); "
        f"async staleness max {max(r['staleness_max'] for r in results['async']):.0f} "
        f"(max_staleness {args.max_staleness})"
    )


if __name__ == "__main__":
    main()
