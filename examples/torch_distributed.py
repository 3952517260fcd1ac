"""torch.distributed inside a worker group: every rank joins one gloo process group and all-reduces.

What it shows:

- each worker process starts with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
  ``MASTER_PORT`` already set, so ``torch.distributed.init_process_group("gloo")`` works unchanged
  (use ``"nccl"`` on GPUs);
- the controller drives the collective with one group call and prints what every rank got;
- the workers tear the process group down before the group shuts down.

``sc.init_distributed()`` does the same initialisation in one call and also picks ``nccl`` and the
GPU ``LOCAL_RANK`` when CUDA is available; this example spells it out with plain torch.

The ranks must run at the same time, so this needs a backend with one process per rank
(``process`` or ``ray``); the inline backend calls ranks one after another and would deadlock.

Needs torch: ``pip install "spmdcall[torch]"``.

Run it:

    python examples/torch_distributed.py [--backend process|ray]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import spmdcall as sc

WORLD_SIZE = 2


class AllReduceWorker:
    """An ordinary class: it reads its rank from the environment, as any torch script would."""

    def __init__(self):
        # init_method defaults to "env://": MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE.
        dist.init_process_group("gloo")
        self.rank = dist.get_rank()

    def env(self) -> dict:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        return {key: os.environ[key] for key in keys}

    def all_reduce(self) -> list[float]:
        tensor = torch.tensor([float(self.rank + 1), 10.0 * self.rank])
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)  # every rank must reach this line
        return tensor.tolist()

    def close(self) -> None:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="process", help="process (default) or ray")
    args = parser.parse_args()
    if args.backend == "inline":
        parser.error(
            "torch.distributed needs every rank running at once; the inline backend runs ranks "
            "one after another in this process. Use --backend process (or ray)."
        )

    pool = sc.ResourcePool([WORLD_SIZE])
    with sc.WorkerGroup(
        pool, sc.ClassWithInitArgs(AllReduceWorker), backend=args.backend, default_timeout=60
    ) as wg:
        for env in wg.env():
            print(f"worker env: {env}")
        assert [env["RANK"] for env in wg.env()] == ["0", "1"]

        reduced = wg.all_reduce()
        print(f"all_reduce(SUM) of [rank + 1, 10 * rank] over {WORLD_SIZE} ranks -> {reduced}")
        expected = [
            float(sum(r + 1 for r in range(WORLD_SIZE))),
            float(sum(10 * r for r in range(WORLD_SIZE))),
        ]
        assert reduced == [expected] * WORLD_SIZE, reduced
        wg.close()

    print("torch_distributed: OK")


if __name__ == "__main__":
    main()
