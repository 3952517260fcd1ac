"""The weight store (spmdcall/data/weights.py): generations of named tensors in shared memory,
written once, loaded as deltas, checked by checksum, versioned, and removed by their owner.

Run: python -m pytest tests/test_weights.py -q
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import spmdcall as sc  # noqa: E402
from spmdcall.data import TensorPiece, WeightPublisher, WeightReader  # noqa: E402
from spmdcall.data.weights import checksum  # noqa: E402


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(100, 16, generator=g),
        "layers.0.weight": torch.randn(300, 300, generator=g),  # several 4 KiB blocks
        "layers.0.bias": torch.randn(7, generator=g).to(torch.bfloat16),  # not a multiple of 8 bytes
        "norm.weight": torch.ones(16),
    }


def _zeros_like(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in weights.items()}


@pytest.fixture
def store(tmp_path):
    with sc.WeightStore(parent=str(tmp_path)) as s:
        yield s
    assert not os.path.exists(s.root)


def test_a_reader_gets_the_published_tensors_and_later_only_what_changed(store):
    weights = _weights()
    publisher, reader = WeightPublisher(store.root), WeightReader(store.root)
    first = publisher.publish(weights, version=3)
    assert (first.number, first.version, first.written) == (1, 3, first.nbytes)
    destination = _zeros_like(weights)
    stats = reader.load_into(destination, at_least=first.number)
    assert (stats.number, stats.version, stats.bytes, stats.changed_fraction) == (1, 3, first.nbytes, 1.0)
    assert all(torch.equal(destination[n], weights[n]) for n in weights)

    weights["norm.weight"] += 1  # one small tensor changes
    second = publisher.publish(weights, version=4)
    stats = reader.load_into(destination, at_least=second.number)
    assert stats.bytes == 16 * 4 and 0 < stats.changed_fraction < 0.01
    assert torch.equal(destination["norm.weight"], weights["norm.weight"])

    third = publisher.publish(weights, version=5)  # nothing changed: nothing to copy
    assert reader.load_into(destination, at_least=third.number).bytes == 0
    # the third goes into the first's slot, which lacks the change made since: only that is written
    assert third.written == 16 * 4
    assert all(torch.equal(destination[n], weights[n]) for n in weights)


def test_the_call_carries_metadata_only(store):
    big = {f"w{i}": torch.ones(1024, 1024) for i in range(8)}  # 32 MiB
    generation = WeightPublisher(store.root).publish(big, version=1)
    assert generation.nbytes == 32 << 20
    assert len(pickle.dumps(generation)) < 4096


def test_a_tensor_corrupted_in_shared_memory_is_named(store):
    weights = _weights()
    generation = WeightPublisher(store.root).publish(weights, version=1)
    entry = next(e for e in generation.entries if e.name == "layers.0.weight")
    with open(Path(store.root, f"slot-{generation.slot}-0.bin"), "r+b") as f:
        f.seek(entry.offset + 1000)
        f.write(b"\xff\xff")
    with pytest.raises(sc.WeightChecksumError, match=r"generation 1: tensor 'layers.0.weight' \(300, 300\)"):
        WeightReader(store.root).load_into(_zeros_like(weights), at_least=1)
    # unchecked, it loads the corruption: the check is what catches it
    destination = _zeros_like(weights)
    WeightReader(store.root).load_into(destination, at_least=1, verify=False)
    assert not torch.equal(destination["layers.0.weight"], weights["layers.0.weight"])


def test_the_checksum_sees_one_changed_word_and_a_swap_of_blocks():
    t = torch.randn(4096)
    base = checksum(t)
    changed = t.clone()
    changed[1234] = changed[1234].item() + 1e-3
    assert checksum(changed) != base
    swapped = t.clone().view(4, 1024)
    swapped[[0, 1]] = swapped[[1, 0]]
    assert checksum(swapped) != base
    assert checksum(t.clone()) == base
    odd = torch.arange(9, dtype=torch.int16)[1:]  # a view at an offset int64 cannot start at
    assert checksum(odd) == checksum(odd.clone())


@pytest.mark.parametrize(
    "t",
    [
        torch.randn(7),
        torch.randn(300, 300),
        torch.randn(3).to(torch.bfloat16),
        torch.arange(9, dtype=torch.int16)[1:],
    ],
    ids=["few words", "many blocks", "odd bytes", "odd offset"],
)
def test_small_tensors_are_summed_with_numpy_to_the_same_checksum_as_torch(t, monkeypatch):
    from spmdcall.data import weights

    small = checksum(t)  # numpy: under _SMALL_BYTES
    monkeypatch.setattr(weights, "_SMALL_BYTES", -1)  # the torch path, which a GPU tensor takes
    assert checksum(t) == small


def test_a_new_reader_finds_the_newest_generation_and_an_old_one_asked_for_gives_a_newer(store):
    publisher = WeightPublisher(store.root)
    reader = WeightReader(store.root)
    assert reader.newest() is None
    with pytest.raises(LookupError, match="holds nothing; generation 1 was asked for"):
        reader.load_into({}, at_least=1)
    for version in range(1, 5):
        weights = _weights(seed=version)
        publisher.publish(weights, version=version * 10)
    destination = _zeros_like(weights)
    stats = WeightReader(store.root).load_into(destination, at_least=1)  # its slot holds 3 now
    assert (stats.number, stats.version) == (4, 40) or stats.number == 3
    assert WeightReader(store.root).newest().number == 4  # type: ignore[union-attr]
    stats = WeightReader(store.root).load_into(destination)
    assert (stats.number, stats.version) == (4, 40)
    assert all(torch.equal(destination[n], weights[n]) for n in weights)
    # a publisher made again (a restarted rank) goes on counting
    assert WeightPublisher(store.root).publish(weights, version=50).number == 5


def test_a_reader_copying_holds_the_publisher_off_its_slot(store):
    weights = _weights()
    publisher = WeightPublisher(store.root)
    publisher.publish(weights, version=1)
    publisher.publish(weights, version=2)
    reader = WeightReader(store.root)
    published = threading.Event()
    with reader.read(at_least=2) as (generation, views):
        assert generation.number == 2
        before = views["embed.weight", 0].clone()
        # generation 3 goes to the other slot at once; generation 4 would overwrite what we read
        publisher.publish(_weights(seed=3), version=3)
        t = threading.Thread(target=lambda: (publisher.publish(_weights(seed=4), version=4), published.set()))
        t.start()
        time.sleep(0.3)
        assert not published.is_set()
        assert torch.equal(views["embed.weight", 0], before)
    t.join(10)
    assert published.is_set()


def test_a_generation_that_does_not_fit_the_destination_is_refused(store):
    weights = _weights()
    WeightPublisher(store.root).publish(weights, version=1)
    destination = _zeros_like(weights)
    destination["extra"] = destination.pop("norm.weight")
    with pytest.raises(
        ValueError, match=r"published but not here \['norm.weight'\], here but not published \['extra'\]"
    ):
        WeightReader(store.root).load_into(destination)
    with pytest.raises(TypeError, match="'b' is a list"):
        WeightPublisher(store.root).publish({"a": torch.ones(1), "b": [1]}, version=1)  # type: ignore[dict-item]
    with pytest.raises(FileNotFoundError, match="make one with sc.WeightStore"):
        WeightPublisher(str(Path(store.root) / "nowhere"))


def test_a_store_left_by_a_dead_owner_is_removed_by_the_next(tmp_path):
    code = "import os, spmdcall as sc; s = sc.WeightStore(parent=os.environ['PARENT']); print(s.root, flush=True); os._exit(0)"
    # os._exit: no clean-up, as after SIGKILL
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=os.environ | {"PARENT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    left = out.stdout.strip()
    assert os.path.isdir(left), out.stderr
    with sc.WeightStore(parent=str(tmp_path)) as store:
        assert not os.path.exists(left)
        assert os.path.isdir(store.root)
    assert list(tmp_path.iterdir()) == []


def test_auto_verification_checks_small_loads_and_gpu_destinations_only(store):
    from spmdcall.data.weights import AUTO_VERIFY_BYTES, should_verify

    small = WeightPublisher(store.root).publish(_weights(), version=1).entries
    big = [dataclasses.replace(small[0], nbytes=AUTO_VERIFY_BYTES + 1)]
    assert should_verify("auto", list(small), on_gpu=False)
    assert not should_verify("auto", big, on_gpu=False)
    assert should_verify("auto", big, on_gpu=True)
    assert should_verify(True, big, on_gpu=False) and not should_verify(False, list(small), on_gpu=True)
    with pytest.raises(ValueError, match="verify must be True, False or 'auto', got 'yes'"):
        should_verify("yes", big, on_gpu=False)


def test_writers_of_a_sharded_model_each_write_their_rows_and_a_reader_gets_the_whole(store):
    from spmdcall.data.weights import commit, next_number

    weights = _weights()
    writers = [WeightPublisher(store.root, writer=w) for w in range(2)]

    def publish(version: int) -> sc.WeightGeneration:
        number = next_number(store.root)
        parts = []
        for w, publisher in enumerate(writers):  # rank w holds rows [w * half, (w + 1) * half), as FSDP2
            pieces = {}
            for name, t in weights.items():
                half = -(-len(t) // 2)
                pieces[name] = TensorPiece(
                    t[w * half : (w + 1) * half], tuple(t.shape), min(w * half, len(t))
                )
            parts.append(publisher.write(pieces, number, version))
        return commit(parts)

    first = publish(1)
    assert first.writers == 2 and len(first.entries) == 2 * len(weights)
    destination = _zeros_like(weights)
    reader = WeightReader(store.root)
    assert reader.load_into(destination, at_least=first.number).bytes == first.nbytes
    assert all(torch.equal(destination[n], weights[n]) for n in weights)

    weights["layers.0.weight"][-1] += 1  # a row that writer 1 holds: only its piece travels
    second = publish(2)
    stats = reader.load_into(destination, at_least=second.number)
    assert stats.bytes == 150 * 300 * 4
    assert torch.equal(destination["layers.0.weight"], weights["layers.0.weight"])
    with reader.read(second.number) as (gen, views):
        whole = reader.whole(gen, views, ["layers.0.weight"])
        assert torch.equal(whole["layers.0.weight"], weights["layers.0.weight"])

    entry = next(e for e in second.entries if e.name == "layers.0.weight" and e.writer == 1)
    with open(Path(store.root, f"slot-{second.slot}-1.bin"), "r+b") as f:
        f.seek(entry.offset)
        f.write(b"\xff" * 8)
    with pytest.raises(sc.WeightChecksumError, match=r"'layers.0.weight' \(300, 300\) rows 150:300"):
        WeightReader(store.root).load_into(_zeros_like(weights), at_least=2)

    lone = writers[0].write({"embed.weight": TensorPiece(weights["embed.weight"][:50], (100, 16), 0)}, 3, 3)
    with pytest.raises(
        ValueError, match=r"the pieces of 'embed.weight' \(100, 16\) cover rows \[\(0, 50\)\]"
    ):
        commit([lone])
