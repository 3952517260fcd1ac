"""The weights of an actor group going to a rollout group of its own, through a weight store.

The actor's rank 0 publishes each policy version into a ``spmdcall`` weight store
(``Actor.publish_weights(version, root)``: written once, into shared memory kept across syncs,
only the tensors that changed); the call returns a ``WeightGeneration`` (metadata), which the
trainer passes to the rollout's ``load_weights``. Each rollout rank maps the store and copies the
tensors that differ from what it holds, checks their checksums (``rollout.verify_weights``), and
reports ``sync/*`` metrics. A rollout rank that (re)starts takes the newest generation itself
(``load_newest_weights(root)``). The bytes never pass through the controller.

The canary (``trainer.weight_canary_atol``): when it publishes, the actor computes the log-probs
of a fixed token sequence and sends them with the generation; each rollout rank computes them
again with what it loaded, and a gap above the tolerance is a ``WeightCanaryError`` naming the
first tensor that differs from what was published (or saying that none does: then the engine
computes differently).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from spmdcall.data import LoadStats, TensorPiece, WeightGeneration, WeightPublisher, WeightReader
from spmdcall.data.weights import commit, next_number, should_verify

__all__ = [
    "Publishers",
    "RolloutWeights",
    "commit_parts",
    "WeightCanaryError",
    "canary_meta",
    "canary_tokens",
    "check_canary",
    "model_log_probs",
    "publish_metrics",
]

CANARY_LENGTH = 32


class WeightCanaryError(ValueError):
    """A rollout rank's log-probs of the canary sequence are not the actor's after a weight sync."""


def canary_tokens(vocab_size: int) -> list[int]:
    """The fixed token sequence both sides score: spread over the vocabulary, the same every sync."""
    return [(7919 * i + 13) % vocab_size for i in range(1, CANARY_LENGTH + 1)]


@torch.no_grad()
def model_log_probs(model: torch.nn.Module, tokens: list[int], device: torch.device | str) -> list[float]:
    """The log-prob of each token after the first under ``model`` (a Hugging Face causal LM)."""
    ids = torch.tensor([tokens], device=device)
    training = model.training
    model.eval()
    try:
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    finally:
        model.train(training)
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].tolist()


def canary_meta(model: torch.nn.Module, device: torch.device | str, atol: float) -> dict[str, Any]:
    """What the actor publishes with a generation for the rollouts to check (nothing if ``atol`` is 0)."""
    if atol <= 0:
        return {}
    tokens = canary_tokens(model.config.vocab_size)
    return {
        "canary_tokens": tokens,
        "canary_log_probs": model_log_probs(model, tokens, device),
        "canary_atol": atol,
    }


def check_canary(
    stats: LoadStats,
    log_probs: Callable[[list[int]], list[float]],
    first_difference: Callable[[], str | None],
) -> dict[str, float]:
    """Compare the rollout's canary log-probs (``log_probs(tokens)``) with the actor's published
    ones; ``WeightCanaryError`` naming ``first_difference()`` past the tolerance. Returns the gap."""
    gen = stats.generation
    if gen is None or "canary_tokens" not in gen.meta:
        return {}
    ours = torch.tensor(log_probs(gen.meta["canary_tokens"]))
    theirs = torch.tensor(gen.meta["canary_log_probs"])
    gap = float((ours - theirs).abs().max().nan_to_num(float("inf")))
    if gap > gen.meta["canary_atol"]:
        name = first_difference()
        where = (
            f"the first tensor that differs from what was published: {name!r}"
            if name is not None
            else "every tensor is what was published, so the engine computes differently from the actor"
        )
        raise WeightCanaryError(
            f"weight generation {gen.number} (version {gen.version}): this rank's log-probs of the canary "
            f"sequence differ from the actor's by {gap:.3g} (more than trainer.weight_canary_atol="
            f"{gen.meta['canary_atol']}); {where}"
        )
    return {"sync/canary_gap": gap}


class Publishers:
    """The publisher of each store a rank publishes into (made on first use, kept across syncs)."""

    def __init__(self) -> None:
        self._by_root: dict[tuple[str, int], WeightPublisher] = {}

    def get(self, root: str, writer: int = 0) -> WeightPublisher:
        publisher = self._by_root.get((root, writer))
        if publisher is None:
            publisher = self._by_root[root, writer] = WeightPublisher(root, writer)
        return publisher

    def write(
        self,
        root: str,
        writer: int,
        tensors: Mapping[str, torch.Tensor | TensorPiece],
        version: int,
        meta: Mapping[str, Any] | None = None,
    ) -> WeightGeneration:
        """This rank's part of the next generation (``commit_parts``, on the controller, commits it)."""
        return self.get(root, writer).write(tensors, next_number(root), version, meta)


def commit_parts(group: object, parts: list) -> WeightGeneration:
    """A collect function: the generation of every rank's part, recorded as the store's newest."""
    return commit(parts)


class RolloutWeights:
    """A rollout rank's side: one reader per store, and what it loaded last.

    Args:
        verify: check the checksum of every tensor loaded (``WeightChecksumError`` names the first
            that differs): "always", "never", or "auto" (where it costs little beside the copy:
            a GPU destination or a small load; ``WeightReader.load_into``).
    """

    def __init__(self, verify: str):
        self.verify: bool | str = {"always": True, "never": False, "auto": "auto"}[verify]
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
        self, root: str, at_least: int, on_gpu: bool
    ) -> Iterator[
        tuple[WeightGeneration, dict[str, tuple[int, ...]], dict[str, torch.Tensor], Callable[[], LoadStats]]
    ]:
        """For an engine that loads tensors its own way (vLLM): the newest generation numbered
        ``at_least`` or more, the shape of each of its tensors, the whole tensors that changed
        since this rank's last load (checked first when ``verify``: views of the store, or joined
        from a sharded actor's pieces), and a function to call once they are loaded, which records
        them and returns the load's stats."""
        start = time.perf_counter()
        reader = self.reader(root)
        with reader.read(at_least) as (gen, views):
            changed = reader.changed(gen)
            verify = should_verify(self.verify, changed, on_gpu)
            if verify:
                reader.verify(views, changed, gen.number)
            shapes = {e.name: e.shape for e in gen.entries}
            tensors = reader.whole(gen, views, dict.fromkeys(e.name for e in changed))

            def done() -> LoadStats:
                reader.mark_loaded(gen)
                return LoadStats.of(gen, changed, time.perf_counter() - start, verify)

            yield gen, shapes, tensors, done

    def first_corrupt(self, gen: WeightGeneration) -> str | None:
        """The name of the first piece of ``gen`` whose bytes in the store are not what was published."""
        with self.reader(gen.root).read(gen.number) as (held, views):
            bad = WeightReader.first_mismatch(views, list(held.entries))
        return None if bad is None else bad.name


def publish_metrics(gen: WeightGeneration) -> dict[str, float]:
    """The actor's side of a sync as step metrics."""
    return {
        "sync/published_bytes": float(gen.written),
        "sync/publish_s": gen.seconds,
        "sync/published_generation": float(gen.number),
    }
