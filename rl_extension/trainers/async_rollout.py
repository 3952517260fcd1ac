"""The rollout side of ``trainer.mode=async`` (#47): a producer thread that fills a bounded buffer with
generated batches while the trainer trains, gated by the weight versions the rollout holds.

Three pieces, shared by the controller's two threads (the trainer's and the producer's):

- ``WeightVersions``: the ``load_weights`` calls the trainer has sent to the rollout group, by
  version. The producer waits here until the rollout holds fresh enough weights.
- ``RolloutProducer``: takes prompt batches from the loader in order, waits for a free buffer slot
  and for weights of version >= k - max_staleness before it starts batch k, generates it (in
  ``trainer.rollout_chunks`` calls, whole groups in prompt order; up to
  ``trainer.rollout_batches_in_flight`` batches at once, each on a thread of its own) and hands the
  batches to the trainer in prompt order.
- ``Timeline``: when the rollout generated and the trainer trained (``timeline.jsonl``), from which
  each step's busy fractions come and ``plot_timeline`` draws.

Batch k is trained at version k (one actor update a step), and it started generating on weights of
version >= k - max_staleness, so no sample is trained past the bound: the producer blocks instead of
generating samples that would be dropped. Nothing is ever dropped, so short responses are not
favoured: whole batches are admitted in prompt order, however long their slowest trajectory takes.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from rl_extension.data.prompts import PromptLoader
from rl_extension.trainers.metrics import mean_metrics
from spmdcall.data import DataProto

__all__ = ["RolloutProducer", "Timeline", "WeightVersions", "staleness_metrics"]

T = TypeVar("T")
_POLL_S = 0.2  # how often a blocked thread looks at the stop flag


class RolloutHealer:
    """Replaces dead rollout ranks while the actor trains: a batch whose call met a dead rank asks
    ``heal``, which restarts the rank (``replace``, the trainer's: the new rank loads the newest
    weights) and lets the batch call again with the same prompts, so no prompt is skipped or
    trained twice. Any thread may call ``heal``; one replacement serves every call that met the
    same death (``epoch``: replacements so far, read by a caller before its call).

    Calls to the rollout group go through ``call``, which holds the gate shared; a replacement or
    a resize (``exclusive``) holds it alone, so that no call reaches a new rank before it has
    loaded the newest weights (it would sample with the checkpoint's).

    Args:
        replace: restarts the dead ranks of the rollout group and loads the newest weights into them.
        max_replacements: replacements in a run, at most; past it the error is raised.
    """

    def __init__(self, replace: Callable[[BaseException], None], max_replacements: int):
        self._replace, self._max = replace, max_replacements
        self._lock = threading.Lock()
        self._gate = threading.Condition()
        self._callers = 0  # calls holding the gate shared
        self._excluding = 0  # replacements or resizes holding or waiting for it
        self.epoch = 0
        self._counts = {"lost": 0, "joined": 0, "left": 0}  # ranks, since the last ``pop_metrics``

    def heal(self, exc: BaseException, epoch: int) -> bool:
        """True if the rollout is whole again (the caller may call again), False to raise ``exc``."""
        from spmdcall import WorkerDiedError

        if not isinstance(exc, WorkerDiedError):
            return False
        with self._lock:
            if self.epoch != epoch:  # replaced since the caller's call began
                return True
            if self.epoch >= self._max:
                return False
            with self.exclusive():
                self._replace(exc)
            self.epoch += 1
            self._counts["lost"] += 1
            self._counts["joined"] += 1
        return True

    def note(self, joined: int = 0, left: int = 0) -> None:
        """Ranks added or removed on request (``AsyncPPOTrainer.scale_rollout``)."""
        with self._lock:
            self._counts["joined"] += joined
            self._counts["left"] += left

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` (a call to the rollout group); if it meets a dead rank, once it is replaced, again."""
        while True:
            epoch = self.epoch
            with self._shared():
                try:
                    return fn()
                except Exception as exc:
                    error = exc
            if not self.heal(error, epoch):
                raise error

    @contextlib.contextmanager
    def _shared(self) -> Iterator[None]:
        with self._gate:
            while self._excluding:
                self._gate.wait()
            self._callers += 1
        try:
            yield
        finally:
            with self._gate:
                self._callers -= 1
                self._gate.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No call to the rollout group starts while the block runs (calls under way finish first)."""
        with self._gate:
            self._excluding += 1
            while self._callers:
                self._gate.wait()
        try:
            yield
        finally:
            with self._gate:
                self._excluding -= 1
                self._gate.notify_all()

    def pop_metrics(self) -> dict[str, float]:
        """``rollout/ranks_lost`` (died), ``rollout/ranks_joined`` (replacements and growth) and
        ``rollout/ranks_left`` (removed on request) since the last call."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return {f"rollout/ranks_{name}": float(n) for name, n in counts.items()}


class ScaleRequests:
    """Requests to change the number of rollout ranks of a running run: ``RUN_DIR/scale.json``,
    written by ``ask`` (``spmdcall-rl scale RUN_DIR --rollout-workers N``, or
    ``AsyncPPOTrainer.scale_rollout`` from any thread) and taken by the trainer at its next step."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "scale.json"

    def ask(self, rollout_workers: int) -> None:
        if isinstance(rollout_workers, bool) or not isinstance(rollout_workers, int) or rollout_workers < 1:
            raise ValueError(f"rollout_workers must be an int >= 1, got {rollout_workers!r}")
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"rollout_workers": rollout_workers, "asked_at": time.time()}))
        os.replace(tmp, self.path)

    def take(self) -> int | None:
        """The number last asked for, once (the request is removed), or None."""
        try:
            request = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        self.path.unlink(missing_ok=True)
        return int(request["rollout_workers"])


class WeightVersions:
    """The weight versions sent to the rollout group, and when each one is in place.

    The trainer calls ``sent(version, future)`` with the future of the ``load_weights`` call; any
    thread may ``wait_for(version)``. Calls to a rank run in submission order, so once a load's
    future is done every rank holds that version or a newer one.

    Args:
        version: the version the rollout holds now (0 at start, the checkpoint's step on resume).
    """

    def __init__(self, version: int, healer: RolloutHealer | None = None):
        self._cond = threading.Condition()
        self._loads: dict[int, Any] = {}  # version -> GroupFuture of its load_weights call
        self._epochs: dict[int, int] = {}  # version -> the healer's epoch when its load was sent
        self._latest = version
        self._finished: list[dict[str, float]] = []  # metrics of loads done, not yet reported
        self.healer = healer

    def sent(self, version: int, future: Any) -> None:
        with self._cond:
            assert version > self._latest, f"version {version} sent after {self._latest}"
            self._loads[version], self._latest = future, version
            self._epochs[version] = self.healer.epoch if self.healer is not None else 0
            self._cond.notify_all()

    def wait_for(self, version: int, stop: threading.Event | None = None) -> bool:
        """Block until the rollout holds weights of ``version`` or newer; False if ``stop`` was set first.
        A failed load raises its error here."""
        with self._cond:
            while self._latest < version:
                if stop is not None and stop.is_set():
                    return False
                self._cond.wait(_POLL_S)
            pending = sorted(v for v in self._loads if v >= version)
            future = self._loads[pending[0]] if pending else None
            epoch = self._epochs.get(pending[0], 0) if pending else 0
        if future is not None:
            while not future.done():
                if stop is not None and stop.is_set():
                    return False
                time.sleep(0.005)
            self._get(future, epoch)
        with self._cond:  # loads before this one are done too (submission order)
            for v in [v for v in self._loads if v <= version]:
                self._finish(v, raising=False)  # its error was raised above, or is left
        return True

    def load_metrics(self) -> dict[str, float]:
        """The ``sync/*`` metrics of the loads finished since the last call (the mean over loads and
        ranks), for the step's metrics; a failed load raises its error here."""
        with self._cond:
            for v in [v for v, f in self._loads.items() if f.done()]:
                self._finish(v, raising=True)
            finished, self._finished = self._finished, []
        return mean_metrics([m for per_rank in finished for m in per_rank if m])

    def _get(self, future: Any, epoch: int) -> list:
        """The load's result; a load that met a dead rank is healed (the replacement loads the newest
        weights itself) and gives no metrics."""
        try:
            return future.get() or []
        except Exception as exc:
            if self.healer is not None and self.healer.heal(exc, epoch):
                return []
            raise

    def _finish(self, version: int, raising: bool) -> None:
        future, epoch = self._loads.pop(version), self._epochs.pop(version, 0)
        try:
            self._finished.append(self._get(future, epoch))
        except Exception:
            if raising:
                raise


class Timeline:
    """Spans of work (``generate`` on the rollout, ``train`` and ``wait`` on the trainer), kept in memory
    for the busy fractions and appended to ``path`` (``timeline.jsonl``) for ``plot_timeline``."""

    def __init__(self, path: Path):
        self._lock = threading.Lock()
        self._spans: list[tuple[str, float, float]] = []
        self._open: dict[int, tuple[str, float]] = {}  # spans under way: key -> (kind, start)
        self._file = open(path, "a")  # noqa: SIM115 (closed by close())
        self.add("session", time.time(), time.time())  # a resumed run appends a session

    def begin(self, kind: str, start: float) -> int:
        """Note a span under way since ``start``: ``busy`` counts it up to its window's end until
        ``add(..., begun=key)`` records it. Returns its key."""
        with self._lock:
            key = max(self._open, default=0) + 1
            self._open[key] = (kind, start)
        return key

    def add(self, kind: str, start: float, end: float, begun: int | None = None, **fields: Any) -> None:
        """Record a span (ending the one ``begin`` returned ``begun`` for); times from ``time.time()``."""
        with self._lock:
            if begun is not None:
                del self._open[begun]
            self._spans.append((kind, start, end))
            self._file.write(json.dumps({"kind": kind, "start": start, "end": end, **fields}) + "\n")
            self._file.flush()

    def busy(self, kind: str, start: float, end: float) -> float:
        """The share of [start, end] covered by spans of ``kind`` (spans that overlap, as those of
        batches generating at once do, count once)."""
        with self._lock:
            spans = self._spans + [(k, s, end) for k, s in self._open.values()]
            clipped = sorted(
                (max(s, start), min(e, end)) for k, s, e in spans if k == kind and s < end and e > start
            )
            self._spans = [span for span in self._spans if span[2] > start]  # older ones are done with
        covered, reached = 0.0, start
        for s, e in clipped:
            covered += max(0.0, e - max(s, reached))
            reached = max(reached, e)
        return covered / max(end - start, 1e-9)

    def close(self) -> None:
        self._file.close()


class RolloutProducer:
    """Generates batch after batch on its own thread, as far ahead as the buffer and the bound allow,
    up to ``len(generators)`` batches at once (``trainer.rollout_batches_in_flight``).

    The producer thread takes prompt batches from the loader in order; batch k starts (on a thread of
    its own, with a free generator) once a buffer slot is free and the rollout holds weights of version
    >= k - max_staleness, so however many batches generate at once, none starts on weights older than
    the bound. Batches finish in any order and are handed to the trainer in prompt order.

    Args:
        generators: prompts -> a scored-to-be batch (``rollout.generate`` or an agent loop's
            ``generate``), one per batch in flight: a batch uses one alone while it generates.
        loader: the prompt loader; only the producer thread iterates it while the producer runs.
        versions: the weight versions of the rollout.
        start: the index of the first batch (the trainer's step).
        stop_at: the index after the last batch to generate (trainer.total_steps).
        max_staleness: trainer.max_staleness.
        buffer_size: batches generated or being generated, not yet taken, at most.
        chunks: calls a batch is generated in.
        timeline: where the generate spans go.
        healer: replaces a rollout rank that died during a call, which is then made again.

    ``take()`` is the trainer's side: the next batch in order, with the seconds it took to generate.
    """

    def __init__(
        self,
        generators: Sequence[Callable[[DataProto], DataProto]],
        loader: PromptLoader,
        versions: WeightVersions,
        *,
        start: int,
        stop_at: int,
        max_staleness: int,
        buffer_size: int,
        chunks: int,
        timeline: Timeline,
        healer: RolloutHealer | None = None,
    ):
        assert 1 <= len(generators) <= max_staleness + 1, (len(generators), max_staleness)
        self._healer = healer
        self._loader, self.versions = loader, versions
        self._next, self._taken, self._stop_at = start, start, stop_at
        self._max_staleness, self._chunks, self.buffer_size = max_staleness, chunks, buffer_size
        self._timeline = timeline
        self._slots = threading.Semaphore(buffer_size)
        self._free: queue.SimpleQueue[Callable[[DataProto], DataProto]] = queue.SimpleQueue()
        for generate in generators:
            self._free.put(generate)
        self._batches = ThreadPoolExecutor(len(generators), thread_name_prefix="rollout-batch")
        self._done: dict[int, tuple[int, DataProto, float]] = {}  # finished, not taken: index -> item
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._loader_states: dict[int, dict] = {}  # batch index -> the loader's state before it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    # -- the trainer's side --------------------------------------------------------------------

    def take(self) -> tuple[int, DataProto, float]:
        """The next generated batch in prompt order: (its index, the batch, seconds spent generating
        it); blocks until it is there. An error of the producer or of any batch is raised here."""
        with self._cond:
            while self._taken not in self._done and self._error is None:
                self._cond.wait(_POLL_S)
            if self._error is not None:
                raise self._error
            item = self._done.pop(self._taken)
            self._taken += 1
        self._slots.release()
        return item

    def fill(self) -> float:
        """The share of the buffer holding finished batches."""
        with self._cond:
            return len(self._done) / self.buffer_size

    def loader_state(self, index: int) -> dict:
        """The loader's state right before batch ``index`` was taken from it (or now, if not yet):
        a checkpoint after ``index`` trained steps resumes from there, so the batches generated but
        not trained are generated again, and no prompt is trained twice or skipped."""
        with self._cond:
            assert index <= self._next, f"batch {index} asked, the producer is at {self._next}"
            state = self._loader_states.get(index) or self._loader.state_dict()
            for old in [i for i in self._loader_states if i < index]:
                del self._loader_states[old]
        return state

    def stop(self) -> None:
        """Start no more batches, wait for those in flight (they are dropped) and for the threads."""
        self._stop.set()
        self._thread.join()
        self._batches.shutdown(wait=True)

    # -- the producer thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            batches = self._prompt_batches()
            while self._next < self._stop_at and self._acquire_slot():
                index = self._next
                if not self.versions.wait_for(index - self._max_staleness, self._stop):
                    return
                generate = self._free_generator()
                if generate is None:
                    return
                with self._cond:
                    self._loader_states[index] = self._loader.state_dict()
                    prompts = next(batches)
                    self._next = index + 1
                self._batches.submit(self._generate_into_buffer, generate, prompts, index)
        except BaseException as exc:  # handed to the trainer, which raises it
            self._fail(exc)

    def _acquire_slot(self) -> bool:
        while not self._slots.acquire(timeout=_POLL_S):
            if self._stop.is_set():
                return False
        return not self._stop.is_set()

    def _free_generator(self) -> Callable[[DataProto], DataProto] | None:
        """A generator no batch is using (waits for a batch in flight to finish); None once stopped."""
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=_POLL_S)
            except queue.Empty:
                pass
        return None

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = self._error or exc
            self._cond.notify_all()

    def _prompt_batches(self) -> Iterator[DataProto]:
        while True:  # one pass of the loader is one epoch
            yield from self._loader

    # -- a batch's thread ----------------------------------------------------------------------

    def _generate_into_buffer(
        self, generate: Callable[[DataProto], DataProto], prompts: DataProto, index: int
    ) -> None:
        try:
            batch, seconds = self._generate_batch(generate, prompts, index)
        except BaseException as exc:  # handed to the trainer, which raises it
            self._fail(exc)
            return
        finally:
            self._free.put(generate)
        with self._cond:
            self._done[index] = (index, batch, seconds)
            self._cond.notify_all()

    def _generate_batch(
        self, generate: Callable[[DataProto], DataProto], prompts: DataProto, index: int
    ) -> tuple[DataProto, float]:
        """Generate in ``chunks`` calls of whole prompts (a prompt's samples stay together); weights sent
        meanwhile reach the calls after the one in flight."""
        parts = prompts.chunk(min(self._chunks, len(prompts)))
        outputs, seconds = [], 0.0
        for part in parts:
            start = time.time()
            begun = self._timeline.begin("generate", start)  # the busy fractions count it meanwhile
            outputs.append(self._call(generate, part))
            end = time.time()
            seconds += end - start
            version = int(outputs[-1].batch["policy_version"].max())
            self._timeline.add("generate", start, end, begun=begun, batch=index, version=version)
        return (DataProto.concat(outputs) if len(outputs) > 1 else outputs[0]), seconds

    def _call(self, generate: Callable[[DataProto], DataProto], part: DataProto) -> DataProto:
        """``generate(part)``; if a rollout rank died meanwhile, once the healer replaced it, again."""
        return generate(part) if self._healer is None else self._healer.call(lambda: generate(part))


def staleness_metrics(batch: DataProto, version: int) -> dict[str, float]:
    """How many versions behind ``version`` (the trainer's) the sampled tokens of ``batch`` are: per
    sample, from its oldest token (``async/staleness_mean``, ``_max``), and per token."""
    data = batch.batch
    mask = data["response_mask"].bool()
    versions = data["policy_version"]
    oldest = torch.where(mask, versions, torch.iinfo(versions.dtype).max).min(-1).values
    lag = (version - oldest[mask.any(-1)]).float()
    token_lag = (version - versions[mask]).float()
    return {
        "async/staleness_mean": lag.mean().item() if len(lag) else 0.0,
        "async/staleness_max": lag.max().item() if len(lag) else 0.0,
        "async/staleness_token_mean": token_lag.mean().item() if len(token_lag) else 0.0,
    }
