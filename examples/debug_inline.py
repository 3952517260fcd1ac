"""Debug worker code with the inline backend: breakpoints and tracebacks that point at your line.

The inline backend builds every rank as an object in the controller's own process and calls them
one after another, so a debugger works inside a worker method exactly as in any Python code.
Arguments and results still go through the same serialisation as the process backend, so code that
works here behaves the same on the other backends.

What it shows:

- ``--break``: a ``breakpoint()`` inside a worker method stops in your terminal on rank 0, once
  per call; look around (``p values``, ``p self.rank``, ``where``) and type ``c`` to go on. Setting the
  environment variable ``PYTHONBREAKPOINT=0`` turns every ``breakpoint()`` into a no-op, so the
  same code runs unattended (``PYTHONBREAKPOINT=0 python examples/debug_inline.py --break``);
- an exception inside a worker method reaches the controller as ``sc.WorkerError`` carrying the
  rank, the method name and the worker's traceback, which starts at your code and names the
  failing line. The group stays usable afterwards.

Run it:

    python examples/debug_inline.py [--break] [--backend inline|process|ray]

The default backend here is ``inline``; the traceback part runs the same on the others, while
``--break`` needs ``inline`` (workers in other processes have no terminal to stop in).
"""

from __future__ import annotations

import argparse
import os

import spmdcall as sc

FAILING_LINE_MARKER = "# <- the traceback points here"


class Normalizer(sc.Worker):
    def __init__(self, stop_in_debugger: bool):
        self.stop_in_debugger = stop_in_debugger

    def normalize(self, values: list[float]) -> list[float]:
        if self.stop_in_debugger and self.rank == 0:
            breakpoint()  # try: p values, p self.rank, then c to continue
        total = sum(values)
        return [v / total for v in values]  # <- the traceback points here


def failing_line_number() -> int:
    with open(__file__) as f:
        lines = f.read().splitlines()
    # The second occurrence: the first is in the constant above.
    return [i for i, line in enumerate(lines, start=1) if line.rstrip().endswith(FAILING_LINE_MARKER)][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inline", help="inline (default), process or ray")
    parser.add_argument(
        "--break", dest="stop", action="store_true", help="stop in pdb inside the worker method"
    )
    args = parser.parse_args()
    if args.stop and args.backend != "inline":
        parser.error("--break needs --backend inline: a worker in another process has no terminal to stop in")

    pool = sc.ResourcePool([2])
    with sc.WorkerGroup(
        pool, sc.ClassWithInitArgs(Normalizer, stop_in_debugger=args.stop), backend=args.backend
    ) as wg:
        result = wg.normalize([1.0, 3.0])
        print(f"normalize([1, 3]) -> {result}")
        assert result == [[0.25, 0.75], [0.25, 0.75]], result

        try:
            wg.normalize([0.0, 0.0])
        except sc.WorkerError as err:
            print(f"caught WorkerError: rank {err.rank}, method {err.method}(), {err.exc_type}")
            print("worker traceback:")
            print(err.remote_traceback)
            assert err.method == "normalize" and err.exc_type == "ZeroDivisionError"
            assert (
                f'{os.path.basename(__file__)}", line {failing_line_number()}, in normalize'
                in err.remote_traceback
            )
            assert "spmdcall" not in err.remote_traceback.splitlines()[1], (
                "the traceback should start at user code"
            )
        else:
            raise AssertionError("dividing by zero did not raise")

        assert wg.normalize([2.0, 2.0]) == [[0.5, 0.5], [0.5, 0.5]]  # still usable after the error

    print("debug_inline: OK")


if __name__ == "__main__":
    main()
