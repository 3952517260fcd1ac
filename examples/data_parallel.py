"""Data-parallel calls on DataProto batches, and one group's pending result fed into another group.

What it shows:

- ``Dispatch.DP_COMPUTE_PROTO``: the controller passes one DataProto; each rank gets a contiguous
  slice of rows, and the results come back as one DataProto with the rows in the input's order.
  A batch that does not divide by the world size (7 rows on 2 ranks) is padded before the split and
  unpadded after the collect, so the caller never sees the padding — even when the method returns
  several rows per input row (here: 2 samples per prompt);
- ``Dispatch.DP_COMPUTE_METRIC``: the same split, but the per-rank results (dicts of metrics) come
  back as a list, one per rank;
- ``blocking=False``: the call returns a ``GroupFuture`` at once; passing it to another group's
  call waits for it there (no ``.get()`` needed in between).

Needs torch: ``pip install "spmdcall[torch]"``.

Run it:

    python examples/data_parallel.py [--backend process|inline|ray]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import spmdcall as sc
from spmdcall.data import DataProto

NUM_SAMPLES = 2  # responses generated per prompt


class Generator(sc.Worker):
    """A stand-in for a rollout engine: 'generates' NUM_SAMPLES responses for every prompt."""

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def generate(self, prompts: DataProto) -> DataProto:
        out = prompts.repeat(NUM_SAMPLES, interleave=True)  # a a b b c c ...
        sample = torch.arange(len(out)) % NUM_SAMPLES
        out.batch["response"] = out.batch["prompt"] * 10 + sample  # prompt 3 -> responses 30, 31
        out.non_tensor_batch["generated_by"] = np.full(len(out), self.rank)
        return out


class Scorer(sc.Worker):
    """A stand-in for a reward model: one score per row, plus per-rank statistics."""

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def score(self, batch: DataProto) -> DataProto:
        scores = (batch.batch["response"] % 2 == 0).float()  # even responses are 'correct'
        return DataProto.from_dict(
            {"score": scores},
            {"scored_by": np.full(len(batch), self.rank)},
        )

    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_METRIC)
    def stats(self, batch: DataProto) -> dict:
        return {
            "rank": self.rank,
            "num_rows": len(batch),
            "mean_prompt": batch.batch["prompt"].float().mean().item(),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="process", help="process (default), inline or ray")
    args = parser.parse_args()

    # Both groups use the same two slots (max_colocate_count=2: two groups may share them).
    pool = sc.ResourcePool([2], max_colocate_count=2)
    prompts = DataProto.from_dict({"prompt": torch.arange(7)}, {"uid": [f"p{i}" for i in range(7)]})

    with (
        sc.WorkerGroup(pool, sc.ClassWithInitArgs(Generator), backend=args.backend) as generators,
        sc.WorkerGroup(pool, sc.ClassWithInitArgs(Scorer), backend=args.backend) as scorers,
    ):
        # 1. Non-blocking: a GroupFuture comes back at once.
        pending = generators.generate(prompts)
        print(f"generate(7 prompts) returned {pending!r}")
        assert isinstance(pending, sc.GroupFuture)

        # 2. Pass the future straight into the other group's call; the rows are split again there.
        scores = scorers.score(pending)
        responses = pending.get()  # already done; .get() returns the same collected DataProto
        print(f"{len(prompts)} prompts -> {len(responses)} responses -> {len(scores)} scores")
        assert len(responses) == len(scores) == 7 * NUM_SAMPLES  # padding row is gone

        # Rows are in the input's order: prompt i's responses are rows 2i and 2i+1.
        assert responses.batch["prompt"].tolist() == [i for i in range(7) for _ in range(NUM_SAMPLES)]
        assert responses.non_tensor_batch["uid"].tolist() == [
            f"p{i}" for i in range(7) for _ in range(NUM_SAMPLES)
        ]
        assert responses.batch["response"].tolist() == [
            10 * i + s for i in range(7) for s in range(NUM_SAMPLES)
        ]
        assert scores.batch["score"].tolist() == [
            float(r % 2 == 0) for r in responses.batch["response"].tolist()
        ]
        # 7 prompts were padded to 8 and split 4 + 4; rank 1's fourth prompt was padding, dropped.
        print(f"generated_by: {responses.non_tensor_batch['generated_by'].tolist()}")
        assert responses.non_tensor_batch["generated_by"].tolist() == [0] * 8 + [1] * 6
        # How the scorers split the rows is the backend's business: most re-split the 14 rows
        # 7 + 7; the ray backend hands each generator rank's output to the same scorer rank (8 + 6).
        scored_by = scores.non_tensor_batch["scored_by"].tolist()
        print(f"scored_by:    {scored_by}")
        assert scored_by == sorted(scored_by) and set(scored_by) == {0, 1}, scored_by

        # 3. Per-rank metrics: a list, one dict per rank. Metrics are not unpadded: with 7 rows
        #    rank 1 also sees the padding row (a copy of row 0), so both ranks report 4 rows.
        metrics = scorers.stats(prompts)
        for m in metrics:
            print(f"stats on rank {m['rank']}: {m}")
        assert [m["rank"] for m in metrics] == [0, 1]
        assert [m["num_rows"] for m in metrics] == [4, 4]
        assert metrics[0]["mean_prompt"] == (0 + 1 + 2 + 3) / 4
        assert metrics[1]["mean_prompt"] == (4 + 5 + 6 + 0) / 4

    print("data_parallel: OK")


if __name__ == "__main__":
    main()
