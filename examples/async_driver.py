"""An asyncio controller keeps two groups busy at once: one makes batches while the other scores the last.

What it shows:

- ``group.method.submit(...)`` returns a ``GroupFuture`` at once, and ``await`` on it waits without
  blocking the event loop; ``asyncio.gather`` runs many calls at once;
- a pipeline written as a plain loop: while the scorer works on batch i, the generator is already
  making batch i + 1, so each step costs the slower stage, not the sum of both;
- an ``async def`` worker method (``Scorer.grade``) runs on its worker's event loop: many calls to
  it overlap on one rank, as they would on a Ray async actor.

It prints the time of the same work done in sequence and pipelined, and the speed-up. (The
``inline`` backend runs a plain method inside the call itself, so there the pipeline cannot
overlap and the speed-up stays near 1.)

Run it:

    python examples/async_driver.py [--backend process|inline|ray] [--steps 6]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import spmdcall as sc

STAGE_S = 0.2  # what making or scoring one batch costs, standing in for generation and a reward model


class Generator(sc.Worker):
    """Stands for a rollout: makes a batch of numbers (one list per rank)."""

    def generate(self, step: int) -> list[int]:
        time.sleep(STAGE_S)
        return [step * 100 + self.rank * 10 + i for i in range(4)]


class Scorer(sc.Worker):
    """Stands for a reward model: scores what it is given; ``grade`` awaits a remote judge."""

    def score(self, batches: list[list[int]]) -> int:
        time.sleep(STAGE_S)
        return sum(sum(batch) for batch in batches)

    async def grade(self, answer: int) -> str:
        await asyncio.sleep(0.05)  # e.g. an HTTP call to a judge: the rank serves other calls meanwhile
        return "even" if answer % 2 == 0 else "odd"


def in_sequence(generator: sc.WorkerGroup, scorer: sc.WorkerGroup, steps: int) -> list[int]:
    return [scorer.score(generator.generate(step))[0] for step in range(steps)]


async def pipelined(generator: sc.WorkerGroup, scorer: sc.WorkerGroup, steps: int) -> list[int]:
    scores = []
    next_batch = generator.generate.submit(0)
    for step in range(steps):
        batches = await next_batch
        if step + 1 < steps:
            next_batch = generator.generate.submit(step + 1)  # runs while the scorer works on `batches`
        scores.append((await scorer.score.submit(batches))[0])
    return scores


async def grade_all(scorer: sc.WorkerGroup, answers: list[int]) -> list[str]:
    graded = await asyncio.gather(*(scorer.grade.submit(a) for a in answers))
    return [per_rank[0] for per_rank in graded]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="process", help="process (default), inline or ray")
    parser.add_argument("--steps", type=int, default=6, help="batches to make and score")
    args = parser.parse_args()

    pool = sc.ResourcePool([2], max_colocate_count=2)  # both groups on the same two slots
    with (
        sc.WorkerGroup(pool, sc.ClassWithInitArgs(Generator), backend=args.backend) as generator,
        sc.WorkerGroup(pool, sc.ClassWithInitArgs(Scorer), backend=args.backend) as scorer,
    ):
        start = time.perf_counter()
        expected = in_sequence(generator, scorer, args.steps)
        sequential_s = time.perf_counter() - start

        start = time.perf_counter()
        scores = asyncio.run(pipelined(generator, scorer, args.steps))
        pipelined_s = time.perf_counter() - start
        assert scores == expected, (scores, expected)

        speed_up = sequential_s / pipelined_s
        print(f"{args.steps} steps in sequence: {sequential_s:.2f} s; pipelined: {pipelined_s:.2f} s")
        print(f"speed-up: {speed_up:.2f}x (at best {2 * args.steps / (args.steps + 1):.2f}x)")
        if args.backend != "inline":
            assert speed_up > 1.25, f"the two groups did not overlap: {speed_up:.2f}x"

        start = time.perf_counter()
        grades = asyncio.run(grade_all(scorer, scores * 20))
        print(f"{len(grades)} async grade() calls at once: {time.perf_counter() - start:.2f} s")
        assert grades == ["even" if s % 2 == 0 else "odd" for s in scores * 20]

    print("async_driver: OK")


if __name__ == "__main__":
    main()
