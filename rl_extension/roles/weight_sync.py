"""The weights of an actor group going to a rollout group of its own, through a weight store.

The actor's rank 0 publishes each policy version into a ``spmdcall`` weight store
(``Actor.publish_weights(version, root)``: written once, into shared memory kept across syncs,
only the tensors that changed); the call returns a ``WeightGeneration`` (metadata), which the
trainer passes to the rollout's ``load_weights``. Each rollout rank maps the store and copies the
tensors that differ from what it holds, checks their checksums (``rollout.verify_weights``), and
reports ``sync/*`` metrics. A rollout rank that (re)starts takes the newest generation itself
(``load_newest_weights(root)``). The bytes never pass through the controller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch

from spmdcall.data import LoadStats, WeightGeneration, WeightPublisher, WeightReader

__all__ = ["Publishers", "RolloutWeights", "publish_metrics"]


class Publishers:
    """The publisher of each store a rank publishes into (made on first use, kept across syncs)."""

    def __init__(self) -> None:
        self._by_root: dict[str, WeightPublisher] = {}

    def publish(self, root: str, tensors: Mapping[str, torch.Tensor], version: int) -> WeightGeneration:
        publisher = self._by_root.get(root)
        if publisher is None:
            publisher = self._by_root[root] = WeightPublisher(root)
        return publisher.publish(tensors, version)


class RolloutWeights:
    """A rollout rank's side: one reader per store, and what it loaded last.

    Args:
        verify: check the checksum of every tensor loaded (``WeightChecksumError`` names the first
            that differs).
    """

    def __init__(self, verify: bool):
        self.verify = verify
        self._readers: dict[str, WeightReader] = {}

    def reader(self, root: str) -> WeightReader:
        reader = self._readers.get(root)
        if reader is None:
            reader = self._readers[root] = WeightReader(root)
        return reader

    def forget(self) -> None:
        """The destination was written some other way (a colocated sync, a checkpoint): the next
        load copies every tensor."""
        for reader in self._readers.values():
            reader.loaded.clear()

    def load_into(self, gen: WeightGeneration, destination: Mapping[str, torch.Tensor]) -> LoadStats:
        """``gen`` (or a newer generation of its store) copied into ``destination``, what changed only."""
        return self.reader(gen.root).load_into(destination, at_least=gen.number, verify=self.verify)

    def load_into_newest(self, root: str, destination: Mapping[str, torch.Tensor]) -> LoadStats:
        """The newest generation of the store at ``root`` copied into ``destination``."""
        return self.reader(root).load_into(destination, verify=self.verify)

    @contextmanager
    def read(
        self, root: str, at_least: int
    ) -> Iterator[tuple[WeightGeneration, dict[str, torch.Tensor], list[str], Callable[[], LoadStats]]]:
        """For an engine that loads tensors its own way (vLLM): the newest generation numbered
        ``at_least`` or more, read-only views of all its tensors, the names of those that changed
        since this rank's last load (checked first when ``verify``), and a function to call once
        they are loaded, which records them and returns the load's stats."""
        start = time.perf_counter()
        reader = self.reader(root)
        with reader.read(at_least) as (gen, views):
            changed = reader.changed(gen)
            if self.verify:
                reader.verify(views, changed, gen.number)

            def done() -> LoadStats:
                reader.mark_loaded(gen)
                moved = sum(e.nbytes for e in changed)
                seconds = time.perf_counter() - start
                return LoadStats(
                    gen.number, gen.version, moved, moved / max(gen.nbytes, 1), seconds, self.verify
                )

            yield gen, views, [e.name for e in changed], done


def publish_metrics(gen: WeightGeneration) -> dict[str, float]:
    """The actor's side of a sync as step metrics."""
    return {
        "sync/published_bytes": float(gen.written),
        "sync/publish_s": gen.seconds,
        "sync/generation": float(gen.number),
    }
