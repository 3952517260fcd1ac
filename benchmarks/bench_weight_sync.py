"""Weights from an actor group to a rollout group of its own: through a weight store (#67) and,
as before, through the controller (#47).

- ``test_store_sync``: ``rollout.load_weights(actor.publish_weights(v, store.root), v)``: rank 0
  writes the tensors that changed into shared memory it keeps across syncs, the call carries
  metadata only, each rollout rank copies what changed and checks its checksum. Interleaved
  rounds of: every tensor changed (checked, and unchecked), a sixteenth of the tensors changed
  (a delta), and ``export_weights`` -> ``load_weights`` through the controller; the bound printed
  beside them is one write plus one copy per rank: 2 memcpys, plus a checksum read on each side.
- ``test_transfer`` (the #47 path alone): ``rollout.load_weights(actor.export_weights.submit(), v)``.

Two sizes, each on ``process`` and ``ray``, beside a plain ``dst.copy_(src)`` of the same bytes:

- the tiny test model (``tests/rl/batches.build_small_model``): a real FSDP2 ``Actor`` (2 ranks) and
  a real ``HFRollout`` (2 ranks), the actor's export gathered from its shards;
- a 0.5 GiB state dict (16 float32 tensors of 2048 x 4096): ``StateDictSource`` copies it out on
  rank 0 as ``Actor.export_weights`` does after its all-gather, ``StateDictSink`` checks and copies
  it in place as the rollouts' ``load_weights`` do.

On ``process`` the weights are copied four times on the way, one after another: rank 0's copy out of
its model, into rank 0's shared-memory segment, from the controller into the segment the rollout
ranks map, and by each rollout rank into its model. Four memcpys of the bytes is therefore the
bound the test prints. Ray runs last (conftest.py), with 4 logical CPUs and its files under
pytest's temp dir, and is shut down at the end.

Run it:

    .venv/bin/python -m pytest benchmarks/bench_weight_sync.py --benchmark-only --benchmark-columns=median,iqr,ops -s
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest

import spmdcall as sc

torch = pytest.importorskip("torch")

WORLD = 2
MIB = 1 << 20
BIG_TENSORS, BIG_SHAPE = 16, (2048, 4096)  # 16 x 32 MiB = 512 MiB of float32
COPIES_ON_PROCESS = 4
ROUNDS = {"tiny": 30, "0.5 GiB": 5}
GROUPS = {
    "tiny": "9a. weight sync actor -> rollout group, tiny model",
    "0.5 GiB": "9b. weight sync actor -> rollout group, 0.5 GiB",
}


def _published_mode() -> Any:
    from rl_extension.roles.actor import PUBLISHED

    return PUBLISHED


def _rank_zero_mode() -> Any:
    from rl_extension.roles.actor import RANK_ZERO_RESULT

    return RANK_ZERO_RESULT


class StateDictSource(sc.Worker):
    """Stands for the actor: every rank runs ``export_weights``, rank 0 alone copies its state dict
    out and returns it (``RANK_ZERO_RESULT``); ``publish_weights`` writes it into a weight store."""

    def __init__(self, num_tensors: int, shape: tuple[int, int]):
        from rl_extension.roles.weight_sync import Publishers

        self.weights = {f"layers.{i}.weight": torch.full(shape, float(i)) for i in range(num_tensors)}
        self.publishers = Publishers()

    @sc.register(dispatch_mode=_published_mode())
    def publish_weights(self, version: int, root: str) -> Any:
        """Each rank writes its rows of every tensor, as the FSDP actor writes its shards."""
        from spmdcall.data import TensorPiece

        pieces = {}
        for name, t in self.weights.items():
            rows = len(t) // self.world_size
            start = self.rank * rows
            pieces[name] = TensorPiece(t[start : start + rows], tuple(t.shape), start)
        return self.publishers.write(root, self.rank, pieces, version)

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def touch(self, fraction: float) -> None:
        """Change the first ``fraction`` of the tensors (as an optimizer step would)."""
        for t in list(self.weights.values())[: max(1, round(fraction * len(self.weights)))]:
            t[0, 0] += 1.0

    @sc.register(dispatch_mode=_rank_zero_mode())
    def export_weights(self) -> dict[str, Any] | None:
        if self.rank != 0:
            return None
        return {name: t.to("cpu", copy=True) for name, t in self.weights.items()}


class StateDictSink(sc.Worker):
    """Stands for a rollout: ``load_weights`` checks names and shapes and copies in place."""

    def __init__(self, num_tensors: int, shape: tuple[int, int]):
        from rl_extension.roles.weight_sync import RolloutWeights

        self.weights = {f"layers.{i}.weight": torch.zeros(shape) for i in range(num_tensors)}
        self.version = -1
        self.weight_sync = RolloutWeights(verify="always")

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def load_weights(self, weights: Any, version: int) -> None:
        from rl_extension.roles.rollout import check_weights

        if isinstance(weights, sc.WeightGeneration):
            self.weight_sync.load_into(weights, self.weights)
        else:
            check_weights(weights, {n: tuple(t.shape) for n, t in self.weights.items()})
            torch._foreach_copy_(list(self.weights.values()), [weights[n] for n in self.weights])
            self.weight_sync.forget()
        self.version = version

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def set_verify(self, verify: bool) -> None:
        self.weight_sync.verify = verify

    @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
    def checksum(self) -> tuple[int, float]:
        return self.version, float(sum(float(t[0, 0] + t[-1, -1]) for t in self.weights.values()))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """The tests' small model (tests/rl/batches.py: build_small_model)."""
    from rl_extension.models import build_tiny_model

    path = tmp_path_factory.mktemp("weights") / "tiny"
    return build_tiny_model(path, num_layers=2, hidden_size=64, num_heads=2, intermediate_size=128)


def _touchable_actor() -> type:
    from rl_extension.roles import Actor

    class TouchableActor(Actor):
        """The actor, whose weights a benchmark can change without a training step."""

        @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
        @torch.no_grad()
        def touch(self, fraction: float) -> None:
            params = list(self.model.parameters())
            for p in params[: max(1, round(fraction * len(params)))]:
                p.add_(1e-3)

    return TouchableActor


def _switchable_rollout() -> type:
    from rl_extension.roles import HFRollout

    class SwitchableRollout(HFRollout):
        """The rollout, whose checksum check a benchmark can switch."""

        @sc.register(dispatch_mode=sc.Dispatch.ONE_TO_ALL)
        def set_verify(self, verify: bool) -> None:
            self.weight_sync.verify = verify

    return SwitchableRollout


def _tiny_groups(path: str, backend: str) -> tuple[sc.WorkerGroup, sc.WorkerGroup]:
    from rl_extension.config import ActorConfig, ModelConfig, RolloutConfig

    model = ModelConfig(path=path)
    actor = sc.ClassWithInitArgs(
        _touchable_actor(),
        model,
        ActorConfig(),
        model_path=path,
        num_mini_batches=1,
        total_steps=1,
        threads=1,
    )
    rollout = sc.ClassWithInitArgs(
        _switchable_rollout(), model, RolloutConfig(), model_path=path, tokenizer_path=path, threads=1
    )
    source = sc.WorkerGroup(sc.ResourcePool([WORLD]), actor, backend=backend, name=f"ws_actor_{backend}")
    return source, sc.WorkerGroup(
        sc.ResourcePool([WORLD]), rollout, backend=backend, name=f"ws_rollout_{backend}"
    )


def _big_groups(backend: str) -> tuple[sc.WorkerGroup, sc.WorkerGroup]:
    args = (BIG_TENSORS, BIG_SHAPE)
    source = sc.WorkerGroup(
        sc.ResourcePool([WORLD]), sc.ClassWithInitArgs(StateDictSource, *args), backend=backend
    )
    return source, sc.WorkerGroup(
        sc.ResourcePool([WORLD]), sc.ClassWithInitArgs(StateDictSink, *args), backend=backend
    )


@pytest.fixture(
    scope="module",
    params=[("process", "tiny"), ("process", "0.5 GiB"), ("ray", "tiny"), ("ray", "0.5 GiB")],
    ids=lambda p: f"{p[0]}-{p[1].replace(' ', '')}",
)
def groups(request):
    backend, size = request.param
    if backend == "ray":
        request.getfixturevalue("ray_session")
    source, sink = (
        _tiny_groups(request.getfixturevalue("tiny_path"), backend)
        if size == "tiny"
        else _big_groups(backend)
    )
    try:
        yield backend, size, source, sink
    finally:
        source.shutdown()
        sink.shutdown()


def _num_bytes(weights: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


SIZES: dict[str, int] = {}  # bytes of each size's state dict, set by its transfer case
MEMCPY_S: dict[str, float] = {}


@pytest.mark.parametrize("size", ["tiny", "0.5 GiB"])
def test_memcpy(case, size, tiny_path):
    if size == "tiny":
        from rl_extension.models import load_causal_lm

        num_bytes = sum(p.numel() * p.element_size() for p in load_causal_lm(tiny_path).parameters())
    else:
        num_bytes = BIG_TENSORS * BIG_SHAPE[0] * BIG_SHAPE[1] * 4
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    bench = case(GROUPS[size], f"memcpy ({size})")
    bench.pedantic(dst.copy_, args=(src,), rounds=200 if size == "tiny" else 20, warmup_rounds=2)
    MEMCPY_S[size] = bench.stats.stats.median
    print(
        f"\nmemcpy {num_bytes / MIB:.1f} MiB: {MEMCPY_S[size] * 1e3:.2f} ms; the bound on process, "
        f"{COPIES_ON_PROCESS} copies one after another: {COPIES_ON_PROCESS * MEMCPY_S[size] * 1e3:.2f} ms"
    )


def test_transfer(case, groups):
    backend, size, source, sink = groups
    SIZES[size] = _num_bytes(source.export_weights())
    versions = iter(range(1, 10_000))

    def transfer() -> None:
        sink.load_weights(source.export_weights.submit(), version=next(versions))

    bench = case(GROUPS[size], f"export -> load, {backend}", baseline=f"memcpy ({size})")
    bench.pedantic(transfer, rounds=ROUNDS[size], warmup_rounds=1)
    if size == "0.5 GiB":
        expected = float(sum(2 * i for i in range(BIG_TENSORS)))
        assert all(v >= 1 and s == expected for v, s in sink.checksum())
    median = bench.stats.stats.median
    bound = (
        f", {COPIES_ON_PROCESS} x memcpy = {COPIES_ON_PROCESS * MEMCPY_S[size] * 1e3:.2f} ms"
        if size in MEMCPY_S
        else ""
    )
    print(f"\n{size} ({SIZES[size] / MIB:.1f} MiB) on {backend}: {median * 1e3:.1f} ms{bound}")


STORE_ROUNDS = {"tiny": 20, "0.5 GiB": 5}
DELTA = 1 / 16  # the share of tensors a delta sync changes


def test_store_sync(case, groups, tmp_path):
    """Interleaved rounds: each side changes the source's weights (untimed), then syncs (timed)."""
    backend, size, source, sink = groups
    nbytes = _num_bytes(source.export_weights())
    versions = iter(range(1, 100_000))
    memcpy = f"memcpy ({size})"
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)

    with sc.WeightStore() as store:

        def sync_store() -> None:
            v = next(versions)
            sink.load_weights(source.publish_weights(v, store.root), v)

        def sync_controller() -> None:
            v = next(versions)
            sink.load_weights(source.export_weights.submit(), v)

        sides: dict[str, tuple[Callable[[], object], Callable[[], None]]] = {
            memcpy: (lambda: None, lambda: dst.copy_(src)),
            "store, every tensor changed, checked": (
                lambda: (sink.set_verify(True), source.touch(1.0)),
                sync_store,
            ),
            "store, every tensor changed, unchecked": (
                lambda: (sink.set_verify(False), source.touch(1.0)),
                sync_store,
            ),
            f"store, {DELTA:.3g} of the tensors changed, checked": (
                lambda: (sink.set_verify(True), source.touch(DELTA)),
                sync_store,
            ),
            "through the controller (export -> load)": (lambda: source.touch(1.0), sync_controller),
        }
        times: dict[str, list[float]] = {label: [] for label in sides}

        def one_round() -> None:
            for label, (prepare, run) in sides.items():
                prepare()
                start = time.perf_counter()
                run()
                times[label].append(time.perf_counter() - start)

        bench = case(GROUPS[size] + ", store", f"one round of every side, {backend}")
        bench.pedantic(one_round, rounds=STORE_ROUNDS[size], warmup_rounds=2)
    bench.extra_info["sides"] = [
        {"label": label, "times": t[2:], **({"baseline": memcpy} if label != memcpy else {})}
        for label, t in times.items()
    ]
    base = statistics.median(times[memcpy][2:])
    print(f"\n{size} ({nbytes / MIB:.1f} MiB) on {backend}; bound 2 memcpys = {2 * base * 1e3:.2f} ms")
    for label, t in times.items():
        median = statistics.median(t[2:])
        print(f"  {label:48s} {median * 1e3:9.2f} ms  {median / base:6.2f}x memcpy")
