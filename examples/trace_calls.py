"""Record group calls as a Chrome/Perfetto trace with ``sc.trace(path)``.

What it shows:

- every group call made inside ``with sc.trace(path):`` is recorded: a ``dispatch`` span and a
  ``collect`` span on the controller, and one span per rank for the method itself (timed inside
  the worker, so slow ranks stand out);
- the file is written when the block ends; open it at https://ui.perfetto.dev or chrome://tracing.

Needs torch: ``pip install "spmdcall[torch]"``.

Run it:

    python examples/trace_calls.py [--backend process|inline|ray] [--out trace.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import Counter

import torch

import spmdcall as sc
from spmdcall.data import DataProto


class Trainer(sc.Worker):
    @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
    def forward(self, batch: DataProto) -> DataProto:
        time.sleep(0.02 * (self.rank + 1))  # rank 1 is the straggler: look for it in the trace
        return DataProto.from_dict({"logits": batch.batch["x"].float() * 2})

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL, execute_mode=sc.Execute.RANK_ZERO)
    def save(self, step: int) -> str:
        return f"checkpoint-{step}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="process", help="process (default), inline or ray")
    parser.add_argument(
        "--out",
        default=os.path.join(tempfile.gettempdir(), "spmdcall-trace-example.json"),
        help="where to write the trace (default: in the temp directory)",
    )
    args = parser.parse_args()

    batch = DataProto.from_dict({"x": torch.arange(8)})
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Trainer), backend=args.backend) as wg:
        wg.forward(batch)  # warm-up, not traced
        with sc.trace(args.out):
            for _step in range(3):
                out = wg.forward(batch)
                assert out.batch["logits"].tolist() == [2.0 * i for i in range(8)]
            assert wg.save(3) == "checkpoint-3"

    with open(args.out) as f:
        events = json.load(f)["traceEvents"]
    spans = Counter(e["name"] for e in events if e["ph"] == "X")
    print(f"trace written to {args.out}: {len(events)} events")
    for name, count in sorted(spans.items()):
        print(f"  {count} x {name}")
    print("open it at https://ui.perfetto.dev (or chrome://tracing)")

    # 3 forward calls: dispatch + collect on the controller, one span per rank (2 ranks).
    assert spans["forward dispatch"] == 3 and spans["forward collect"] == 3 and spans["forward"] == 3 * 2, (
        spans
    )
    # save runs on rank 0 only.
    assert spans["save dispatch"] == 1 and spans["save"] == 1, spans
    print("trace_calls: OK")


if __name__ == "__main__":
    main()
