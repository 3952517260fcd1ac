"""Drive classes as 2-rank worker groups: an undecorated class, and a ``sc.Worker`` subclass.

What it shows:

- any ordinary class works as a worker: no base class, no ``@sc.register``. Each public method
  becomes a group method that sends the same arguments to every rank and returns a list with one
  result per rank;
- subclassing ``sc.Worker`` adds ``self.rank`` / ``self.world_size`` (nothing else changes);
- ``wg.execute_rank_zero(name, ...)`` runs a method on rank 0 alone and returns its plain result,
  and ``wg.execute_all(name, ...)`` is the spelled-out form of a plain call.

Run it:

    python examples/any_class.py [--backend process|inline|ray]
"""

from __future__ import annotations

import argparse
import os
from collections import Counter

import spmdcall as sc


class WordCounter:
    """An ordinary class someone already had. spmdcall needs no change to it."""

    def __init__(self, lowercase: bool):
        self.lowercase = lowercase
        self.counts: Counter[str] = Counter()

    def add(self, text: str) -> int:
        words = text.lower().split() if self.lowercase else text.split()
        self.counts.update(words)
        return sum(self.counts.values())

    def most_common(self, n: int) -> list[tuple[str, int]]:
        return self.counts.most_common(n)


class Shard(sc.Worker):
    """Knows its place in the group: keeps every ``world_size``-th item, starting at its rank."""

    def __init__(self, items: list[int]):
        self.mine = items[self.rank :: self.world_size]  # self.rank is already set inside __init__

    def describe(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(), "items": self.mine}

    def total(self) -> int:
        return sum(self.mine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="process", help="process (default), inline or ray")
    args = parser.parse_args()

    pool = sc.ResourcePool([2])  # two ranks on this machine

    with sc.WorkerGroup(pool, sc.ClassWithInitArgs(WordCounter, lowercase=True), backend=args.backend) as wg:
        print(f"{wg} exposes {wg.method_names()}")
        totals = wg.add("the cat saw The dog")  # every rank gets the same text ...
        print(f"add(...) -> {totals}   (one result per rank)")
        assert totals == [5, 5], totals  # ... so every rank holds the same counts
        assert wg.execute_all("add", "the end") == [7, 7]  # the same call, spelled out
        top = wg.execute_rank_zero("most_common", 1)  # rank 0 only: its result, not a list
        print(f"execute_rank_zero('most_common', 1) -> {top}")
        assert top == [("the", 3)], top

    with sc.WorkerGroup(pool, sc.ClassWithInitArgs(Shard, list(range(10))), backend=args.backend) as wg:
        for info in wg.describe():
            print(f"rank {info['rank']}/{info['world_size']} (pid {info['pid']}) holds {info['items']}")
        per_rank = wg.total()
        print(f"total() -> {per_rank}, summed on the controller: {sum(per_rank)}")
        assert per_rank == [0 + 2 + 4 + 6 + 8, 1 + 3 + 5 + 7 + 9], per_rank
        assert [i["rank"] for i in wg.describe()] == [0, 1]
        assert wg.execute_rank_zero("describe")["rank"] == 0

    print("any_class: OK")


if __name__ == "__main__":
    main()
