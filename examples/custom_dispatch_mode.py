"""Write your own dispatch modes: how a call's arguments are split over ranks and results merged.

What it shows:

- ``sc.register_dispatch_mode(name, dispatch_fn, collect_fn)`` adds a mode to the registry. The
  returned mode object goes into ``@sc.register(dispatch_mode=...)``, and so does its name string;
  here ``ROUND_ROBIN`` deals the items of a Python list to the ranks like cards and gathers the
  per-rank result lists back into one sorted list;
- a one-off mode needs no registration: ``{"dispatch_fn": ..., "collect_fn": ...}`` — here the
  built-in ONE_TO_ALL dispatch paired with a collect that sums the per-rank results;
- a dispatch function may reject bad input with ``TypeError``/``ValueError``; nothing is sent then.

The signatures are verl's: ``dispatch_fn(group, *args, **kwargs) -> (args, kwargs)`` where every
value is a list with one entry per rank, and ``collect_fn(group, outputs) -> result``.

Run it:

    python examples/custom_dispatch_mode.py [--backend process|inline|ray]
"""

from __future__ import annotations

import argparse

import spmdcall as sc


def deal_round_robin(group, items, **kwargs):
    """Rank r gets items r, r + n, r + 2n, ... of the list; keyword arguments go to every rank."""
    if not isinstance(items, list):
        raise TypeError(f"ROUND_ROBIN expects a list to deal out, got {type(items).__name__}")
    n = group.world_size
    per_rank = [items[rank::n] for rank in range(n)]
    return (per_rank,), {key: [value] * n for key, value in kwargs.items()}


def gather_sorted(group, outputs):
    """Every rank returned a list; merge them into one sorted list."""
    return sorted(item for rank_output in outputs for item in rank_output)


def sum_over_ranks(group, outputs):
    return sum(outputs)


ROUND_ROBIN = sc.register_dispatch_mode("ROUND_ROBIN", deal_round_robin, gather_sorted)
SUM = {"dispatch_fn": sc.Dispatch.ONE_TO_ALL.dispatch_fn, "collect_fn": sum_over_ranks}


def is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


class PrimeFinder(sc.Worker):
    @sc.register(dispatch_mode=ROUND_ROBIN)  # by object
    def keep_primes(self, numbers: list[int]) -> list[int]:
        return [n for n in numbers if is_prime(n)]

    @sc.register(dispatch_mode="ROUND_ROBIN")  # by name, looked up when the group binds it
    def label(self, words: list[str], suffix: str = "") -> list[str]:
        return [f"{word}{suffix}@rank{self.rank}" for word in words]

    @sc.register(dispatch_mode=SUM)  # a one-off mode, no name needed
    def count_primes_below(self, limit: int) -> int:
        # Every rank gets the same limit and checks its own stride of the numbers.
        return sum(is_prime(n) for n in range(self.rank, limit, self.world_size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="process", help="process (default), inline or ray")
    args = parser.parse_args()

    assert "ROUND_ROBIN" in sc.available_dispatch_modes()
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(PrimeFinder), backend=args.backend) as wg:
        numbers = [20, 19, 18, 17, 13, 12, 11, 7, 5, 4, 3, 2]
        primes = wg.keep_primes(numbers)
        print(f"keep_primes({numbers}) -> {primes}")
        assert primes == [2, 3, 5, 7, 11, 13, 17, 19], primes

        labels = wg.label(["c", "a", "d", "b"], suffix="!")
        print(f"label(['c', 'a', 'd', 'b'], suffix='!') -> {labels}")
        assert labels == ["a!@rank1", "b!@rank1", "c!@rank0", "d!@rank0"], labels

        total = wg.count_primes_below(100)
        print(f"count_primes_below(100) -> {total}   (the sum of both ranks' counts)")
        assert total == 25, total

        try:
            wg.keep_primes(42)
        except TypeError as exc:
            print(f"keep_primes(42) -> TypeError: {exc}")
        else:
            raise AssertionError("ROUND_ROBIN accepted a non-list")

    print("custom_dispatch_mode: OK")


if __name__ == "__main__":
    main()
