"""Tests for spmdcall.data (DataProto). Fast, single process: pytest tests/test_data.py -q"""

import copy
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict")

from tensordict import TensorDict  # noqa: E402

from spmdcall.data import DataProto, DataProtoItem, pad_dataproto_to_divisor, unpad_dataproto  # noqa: E402


def make(n=6, meta=None):
    """Rows i have x = [2i, 2i+1], y = i, uid = f"u{i}"."""
    return DataProto.from_dict(
        tensors={"x": torch.arange(2 * n, dtype=torch.float32).reshape(n, 2), "y": torch.arange(n)},
        non_tensors={"uid": [f"u{i}" for i in range(n)]},
        meta_info=dict(meta or {"temperature": 1.0}),
    )


def rows(dp):
    """The y column and uid column as plain lists, to compare row order."""
    return dp.batch["y"].tolist(), list(dp.non_tensor_batch["uid"])


def oob_bytes(buffers):
    return sum(len(memoryview(b).cast("B")) for b in buffers)


# ----------------------------------------------------------------------- construction
def test_from_dict_builds_columns_and_meta():
    dp = make(4)
    assert len(dp) == 4
    assert dp.batch.batch_size == torch.Size([4])
    assert dp.non_tensor_batch["uid"].dtype == object
    assert dp.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u3"]
    assert dp.meta_info == {"temperature": 1.0}
    assert torch.equal(dp.batch["x"][3], torch.tensor([6.0, 7.0]))


def test_rows_are_the_only_batch_dim():
    # As in verl: every column's first dim is the rows; more batch dims are refused, both ways in.
    dp = DataProto.from_dict({"a": torch.zeros(2, 3, 4), "b": torch.ones(2, 3)})
    assert dp.batch.batch_size == torch.Size([2]) and len(dp) == 2
    with pytest.raises(ValueError, match="exactly one batch dim"):
        DataProto.from_dict({"a": torch.zeros(2, 3, 4), "b": torch.ones(2, 3)}, num_batch_dims=2)
    with pytest.raises(ValueError, match="exactly one batch dim"):
        DataProto(batch=TensorDict({"a": torch.zeros(2, 3)}, batch_size=[2, 3]))


def test_list_of_lists_stays_one_object_per_row():
    dp = DataProto.from_dict({"x": torch.zeros(2)}, {"tokens": [[1, 2], [3, 4]]})
    assert dp.non_tensor_batch["tokens"].shape == (2,)
    assert dp.non_tensor_batch["tokens"][1] == [3, 4]


def test_from_single_dict_splits_tensors_and_arrays():
    dp = DataProto.from_single_dict(
        {"x": torch.arange(3), "tag": np.array(["a", "b", "c"]), "obj": [{"k": 1}, None, 3]},
        meta_info={"m": 1},
    )
    assert list(dp.batch.keys()) == ["x"]
    assert sorted(dp.non_tensor_batch) == ["obj", "tag"]
    assert dp.non_tensor_batch["obj"][0] == {"k": 1}
    assert dp.meta_info == {"m": 1}
    with pytest.raises(TypeError, match="bad"):
        DataProto.from_single_dict({"bad": 3})


def test_mismatched_lengths_name_the_columns():
    with pytest.raises(ValueError, match=r"input_ids=4.*labels=3|labels=3.*input_ids=4"):
        DataProto.from_dict({"input_ids": torch.zeros(4, 2), "labels": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"x=3.*uid=2"):
        DataProto.from_dict({"x": torch.zeros(3)}, {"uid": ["a", "b"]})
    with pytest.raises(ValueError, match=r"a=2.*b=5"):
        DataProto(non_tensor_batch={"a": np.zeros(2), "b": np.zeros(5)})
    with pytest.raises(TypeError):
        DataProto(batch={"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="0-d"):
        DataProto(non_tensor_batch={"a": np.array(3)})


def test_empty_and_batchless():
    assert len(DataProto()) == 0
    only_np = DataProto(non_tensor_batch={"a": np.arange(3)})
    assert len(only_np) == 3 and only_np.batch is None
    assert list(only_np[1:].non_tensor_batch["a"]) == [1, 2]
    assert list(DataProto()) == []  # iteration stops instead of looping forever


# ----------------------------------------------------------------------- indexing
def test_int_index_returns_item():
    dp = make(4)
    item = dp[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["y"].item() == 2 and item.non_tensor_batch["uid"] == "u2"
    assert item.meta_info == {"temperature": 1.0}
    assert dp[-1].non_tensor_batch["uid"] == "u3"
    assert dp[np.int64(1)].batch["y"].item() == 1
    with pytest.raises(IndexError):
        dp[4]
    assert [it.non_tensor_batch["uid"] for it in dp] == ["u0", "u1", "u2", "u3"]


@pytest.mark.parametrize(
    "index, expected",
    [
        (slice(1, 5, 2), [1, 3]),
        (slice(None, None, -2), [5, 3, 1]),
        ([4, 0, 0], [4, 0, 0]),
        ([-1], [5]),
        (np.array([3, 1]), [3, 1]),
        (torch.tensor([2, 5]), [2, 5]),
        ([True, False, True, False, False, True], [0, 2, 5]),
        (np.array([False] * 6), []),
        (torch.tensor([False, True, False, False, False, False]), [1]),
        ([], []),
    ],
)
def test_row_indexing(index, expected):
    out = make(6)[index]
    assert isinstance(out, DataProto)
    assert rows(out) == (expected, [f"u{i}" for i in expected])
    assert out.batch["x"][:, 0].tolist() == [2.0 * i for i in expected]


def test_bad_indices():
    dp = make(3)
    with pytest.raises(ValueError, match="mask"):
        dp[[True, False]]
    with pytest.raises(IndexError):
        dp[[0, 3]]
    with pytest.raises(TypeError):
        dp[[0.5]]
    with pytest.raises(TypeError):
        dp["x"]


# ----------------------------------------------------------------------- columns
def test_select_keys_and_deepcopy():
    dp = make(3, meta={"a": [1], "b": 2})
    sel = dp.select(batch_keys=["x"], non_tensor_batch_keys=[], meta_info_keys=["a"])
    assert list(sel.batch.keys()) == ["x"] and sel.non_tensor_batch == {} and sel.meta_info == {"a": [1]}
    assert sel.batch["x"].data_ptr() == dp.batch["x"].data_ptr()  # shared
    everything = dp.select()
    assert sorted(everything.batch.keys()) == ["x", "y"] and list(everything.non_tensor_batch) == ["uid"]
    deep = dp.select(deepcopy=True)
    deep.batch["x"][0, 0] = 100.0
    deep.meta_info["a"].append(5)
    deep.non_tensor_batch["uid"][0] = "changed"
    assert dp.batch["x"][0, 0].item() == 0.0 and dp.meta_info["a"] == [1]
    assert dp.non_tensor_batch["uid"][0] == "u0"
    with pytest.raises(KeyError):
        dp.select(non_tensor_batch_keys=["missing"])


def test_select_idxs_and_slice():
    dp = make(5)
    assert rows(dp.select_idxs([4, 2])) == ([4, 2], ["u4", "u2"])
    assert rows(dp.select_idxs(np.array([True, False, False, False, True]))) == ([0, 4], ["u0", "u4"])
    s = dp.slice(1, 4)
    assert rows(s) == ([1, 2, 3], ["u1", "u2", "u3"])
    assert rows(dp.slice(step=2)) == ([0, 2, 4], ["u0", "u2", "u4"])
    s.batch["y"][0] = 42  # a positive-step slice is a view
    assert dp.batch["y"][1].item() == 42


def test_pop():
    dp = make(3, meta={"a": 1, "b": 2})
    popped = dp.pop(batch_keys=["x"], non_tensor_batch_keys=["uid"], meta_info_keys=["a"])
    assert torch.equal(popped.batch["x"], torch.arange(6.0).reshape(3, 2))
    assert popped.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2"] and popped.meta_info == {"a": 1}
    assert list(dp.batch.keys()) == ["y"] and dp.non_tensor_batch == {} and dp.meta_info == {"b": 2}
    with pytest.raises(KeyError):
        dp.pop(batch_keys=["y"], meta_info_keys=["nope"])
    assert list(dp.batch.keys()) == ["y"]  # nothing removed when a key is missing
    assert dp.pop().batch is None


def test_rename():
    dp = make(2)
    assert dp.rename("x", "features") is dp
    dp.rename(["y", "uid"], ["label", "id"])
    assert sorted(dp.batch.keys()) == ["features", "label"] and list(dp.non_tensor_batch) == ["id"]
    assert dp.batch["label"].tolist() == [0, 1]
    with pytest.raises(KeyError):
        dp.rename("nope", "x")
    with pytest.raises(ValueError):
        dp.rename(["a", "b"], ["c"])


def test_union():
    dp = make(3, meta={"a": 1})
    other = DataProto.from_dict(
        {"z": torch.tensor([7, 8, 9]), "y": torch.arange(3)}, {"extra": [1, 2, 3]}, {"b": 2}
    )
    assert dp.union(other) is dp
    assert sorted(dp.batch.keys()) == ["x", "y", "z"] and dp.batch["z"].tolist() == [7, 8, 9]
    assert dp.non_tensor_batch["extra"].tolist() == [1, 2, 3] and dp.meta_info == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match="y"):
        dp.union(DataProto.from_dict({"y": torch.tensor([0, 1, 5])}))
    with pytest.raises(ValueError, match="uid"):
        dp.union(DataProto.from_dict(non_tensors={"uid": ["u0", "u1", "x"]}))
    with pytest.raises(ValueError, match="meta_info"):
        dp.union(DataProto(meta_info={"a": 2}))
    with pytest.raises(ValueError, match="rows"):
        dp.union(make(4))
    assert DataProto(meta_info={"m": 1}).union(make(2)).batch["y"].tolist() == [0, 1]


# ----------------------------------------------------------------------- splitting and joining
@pytest.mark.parametrize(
    "n, chunks, sizes",
    [(7, 2, [4, 3]), (6, 3, [2, 2, 2]), (10, 4, [3, 3, 2, 2]), (2, 4, [1, 1, 0, 0]), (0, 3, [0, 0, 0])],
)
def test_chunk_uneven(n, chunks, sizes):
    dp = make(n)
    parts = dp.chunk(chunks)
    assert [len(p) for p in parts] == sizes
    assert sum((rows(p)[0] for p in parts), []) == list(range(n))
    assert all(p.meta_info == dp.meta_info for p in parts)
    with pytest.raises(ValueError):
        dp.chunk(0)


def test_split():
    parts = make(5).split(2)
    assert [rows(p)[0] for p in parts] == [[0, 1], [2, 3], [4]]
    assert [p.non_tensor_batch["uid"].tolist() for p in parts][-1] == ["u4"]
    with pytest.raises(ValueError):
        make(5).split(0)


def test_concat_round_trips_chunks_and_merges_metrics():
    dp = make(7)
    parts = dp.chunk(3)
    parts[0].meta_info = {"metrics": {"loss": 1.0, "acc": [0.1, 0.2]}, "step": 1}
    parts[1].meta_info = {"metrics": [{"loss": 2.0}], "step": 1}  # verl workers also send lists of dicts
    parts[2].meta_info = {"metrics": {"loss": [3.0, 4.0], "acc": 0.3}, "other": "x"}
    out = DataProto.concat(parts)
    assert rows(out) == rows(dp)
    assert torch.equal(out.batch["x"], dp.batch["x"])
    assert out.meta_info == {
        "metrics": {"loss": [1.0, 2.0, 3.0, 4.0], "acc": [0.1, 0.2, 0.3]},
        "step": 1,
        "other": "x",
    }
    # A key the parts disagree on is an error, never silently one part's value; verl code that
    # catches AssertionError (verl asserts here) still catches it.
    parts[1].meta_info["step"] = 2
    with pytest.raises(ValueError, match="Conflicting values for meta_info key 'step'"):
        DataProto.concat(parts)
    with pytest.raises(AssertionError):
        DataProto.concat(parts)


def test_concat_with_empty_parts_and_errors():
    dp = make(2)
    assert rows(DataProto.concat(dp.chunk(4))) == rows(dp)
    with pytest.raises(ValueError):
        DataProto.concat([])
    with pytest.raises(ValueError, match="keys differ"):
        DataProto.concat([dp, dp.select(batch_keys=["x"])])
    with pytest.raises(ValueError, match="only some"):
        DataProto.concat([dp, DataProto(non_tensor_batch={"uid": np.array(["a"], dtype=object)})])


def test_repeat_interleave_and_tile():
    dp = make(3)
    inter = dp.repeat(2, interleave=True)
    assert rows(inter) == ([0, 0, 1, 1, 2, 2], ["u0", "u0", "u1", "u1", "u2", "u2"])
    assert inter.batch["x"][:, 1].tolist() == [1.0, 1.0, 3.0, 3.0, 5.0, 5.0]
    tiled = dp.repeat(repeat_times=3, interleave=False)
    assert rows(tiled)[0] == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert tiled.non_tensor_batch["uid"].tolist()[3:6] == ["u0", "u1", "u2"]


def test_reorder_in_place():
    dp = make(4)
    assert dp.reorder(torch.tensor([3, 1, 0, 2])) is None
    assert rows(dp) == ([3, 1, 0, 2], ["u3", "u1", "u0", "u2"])
    dp.reorder([1, 0, 2, 3])
    assert dp.batch["x"][:, 0].tolist() == [2.0, 6.0, 0.0, 4.0]


# ----------------------------------------------------------------------- make_iterator
def test_make_iterator_in_order():
    batches = list(make(5).make_iterator(mini_batch_size=2, epochs=2))
    assert [rows(b)[0] for b in batches] == [[0, 1], [2, 3], [4], [0, 1], [2, 3], [4]]
    dropped = list(make(5).make_iterator(2, epochs=1, dataloader_kwargs={"drop_last": True}))
    assert [rows(b)[0] for b in dropped] == [[0, 1], [2, 3]]


def test_make_iterator_seeded_shuffle_is_reproducible():
    dp = make(8)

    def orders(seed):
        it = dp.make_iterator(4, epochs=3, seed=seed, dataloader_kwargs={"shuffle": True})
        return [rows(b)[0] for b in it]

    first = orders(123)
    assert first == orders(123)
    assert first != orders(7)
    assert len(first) == 6
    for epoch in range(3):  # every epoch is a permutation of all rows, and the epochs differ
        assert sorted(first[2 * epoch] + first[2 * epoch + 1]) == list(range(8))
    assert len({tuple(first[2 * e] + first[2 * e + 1]) for e in range(3)}) > 1
    for b in dp.make_iterator(4, epochs=1, seed=0, dataloader_kwargs={"shuffle": True}):
        assert all(b.non_tensor_batch["uid"][i] == f"u{y}" for i, y in enumerate(rows(b)[0]))


def test_make_iterator_checks_arguments_eagerly():
    with pytest.raises(ValueError):
        make(4).make_iterator(0, epochs=1)
    with pytest.warns(UserWarning, match="num_workers"):
        make(4).make_iterator(2, epochs=1, dataloader_kwargs={"num_workers": 2})


# ----------------------------------------------------------------------- padding
@pytest.mark.parametrize("n", range(1, 10))
@pytest.mark.parametrize("divisor", range(1, 5))
def test_pad_unpad_round_trip(n, divisor):
    dp = make(n, meta={"metrics": {"a": 1}})
    padded, pad_size = pad_dataproto_to_divisor(dp, divisor)
    assert len(padded) % divisor == 0 and len(padded) == n + pad_size and 0 <= pad_size < divisor
    expected = list(range(n)) + [i % n for i in range(pad_size)]  # leading rows, cycling
    assert rows(padded) == (expected, [f"u{i}" for i in expected])
    assert padded.meta_info == dp.meta_info
    out = unpad_dataproto(padded, pad_size)
    assert rows(out) == rows(dp) and torch.equal(out.batch["x"], dp.batch["x"])


def test_pad_errors_and_empty():
    assert pad_dataproto_to_divisor(make(0), 3)[1] == 0
    with pytest.raises(ValueError):
        pad_dataproto_to_divisor(make(3), 0)
    with pytest.raises(ValueError):
        unpad_dataproto(make(3), 4)


# ----------------------------------------------------------------------- device, info
def test_to_and_info():
    dp = make(2)
    assert dp.to("cpu") is dp and dp.batch.device == torch.device("cpu")
    info = dp.get_data_info()
    assert "float32[2, 2]" in info and "int64[2]" in info and "uid" in info and "temperature" in info
    assert "rows=2" in repr(dp) and "x: float32[2, 2]" in repr(dp)
    dp.check_consistency()


# ----------------------------------------------------------------------- persistence and pickling
def assert_same(a, b):
    assert len(a) == len(b)
    assert (a.batch is None) == (b.batch is None)
    if a.batch is not None:
        assert sorted(a.batch.keys()) == sorted(b.batch.keys())
        for k in a.batch.keys():
            assert a.batch[k].dtype == b.batch[k].dtype and torch.equal(a.batch[k], b.batch[k])
    assert sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for k in a.non_tensor_batch:
        assert a.non_tensor_batch[k].dtype == b.non_tensor_batch[k].dtype
        assert a.non_tensor_batch[k].tolist() == b.non_tensor_batch[k].tolist()
    assert a.meta_info == b.meta_info


def rich():
    n = 4
    return DataProto.from_dict(
        {
            "f": torch.randn(n, 3),
            "bf": torch.randn(n, 5).to(torch.bfloat16),
            "i": torch.arange(n),
            "mask": torch.tensor([True, False, True, True]),
            "h": torch.randn(n, 2).half(),
        },
        {"uid": ["a", "b", "c", "d"], "score": np.array([0.5, 1.5, 2.5, 3.5])},
        {"metrics": {"loss": [1.0]}, "step": 3},
    )


def test_save_load_round_trip(tmp_path):
    dp = rich()
    path = tmp_path / "batch.pkl"
    dp.save_to_disk(path)
    assert path.stat().st_size > 0
    assert_same(DataProto.load_from_disk(path), dp)
    assert_same(DataProto.load_from_disk(str(path)), dp)


@pytest.mark.parametrize("protocol", [2, 4, 5, None])
def test_plain_pickle_round_trip(protocol):
    dp = rich()
    assert_same(pickle.loads(pickle.dumps(dp, protocol=protocol)), dp)
    assert_same(copy.deepcopy(dp), dp)


def test_out_of_band_buffers_hold_the_tensor_bytes():
    dp = DataProto.from_dict(
        {"a": torch.randn(1024, 256), "b": torch.arange(1024 * 8).reshape(1024, 8)}, {"uid": np.arange(1024)}
    )
    tensor_bytes = sum(t.numel() * t.element_size() for t in dp.batch.values())
    bufs = []
    payload = pickle.dumps(dp, protocol=5, buffer_callback=bufs.append)
    assert all(isinstance(b, pickle.PickleBuffer) for b in bufs)
    assert oob_bytes(bufs) == tensor_bytes + dp.non_tensor_batch["uid"].nbytes
    assert len(payload) < 2048  # only metadata in-band
    out = pickle.loads(payload, buffers=bufs)
    assert_same(out, dp)
    # Writable buffers are wrapped, not copied: the received tensor aliases the sent memory.
    assert out.batch["a"].data_ptr() == dp.batch["a"].data_ptr()


def test_chunk_pickles_only_its_own_rows():
    dp = DataProto.from_dict({"a": torch.randn(1000, 64), "b": torch.randn(1000, 4).to(torch.bfloat16)})
    full, half = [], []
    pickle.dumps(dp, protocol=5, buffer_callback=full.append)
    first = dp.chunk(2)[0]
    pickle.dumps(first, protocol=5, buffer_callback=half.append)
    assert oob_bytes(half) * 2 == oob_bytes(full)
    strided = []  # a strided slice is made contiguous, still only its own rows
    pickle.dumps(dp[::4], protocol=5, buffer_callback=strided.append)
    assert oob_bytes(strided) * 4 == oob_bytes(full)
    assert_same(pickle.loads(pickle.dumps(first, protocol=5)), first)


def test_read_only_buffers_are_copied():
    dp = DataProto.from_dict({"a": torch.arange(10.0), "bf": torch.arange(10.0).to(torch.bfloat16)})
    bufs = []
    payload = pickle.dumps(dp, protocol=5, buffer_callback=bufs.append)
    readonly = [bytes(memoryview(b).cast("B")) for b in bufs]
    out = pickle.loads(payload, buffers=readonly)
    out.batch["a"][0] = 5.0  # must be safe: writes go to a private copy
    out.batch["bf"][1] = 7.0
    assert out.batch["a"][0].item() == 5.0 and out.batch["bf"][1].item() == 7.0
    assert dp.batch["a"][0].item() == 0.0


def test_bf16_round_trip_exact():
    t = torch.randn(3, 7).to(torch.bfloat16)
    dp = DataProto.from_dict({"t": t, "z": torch.zeros(3, 0, dtype=torch.bfloat16)})
    bufs = []
    out = pickle.loads(pickle.dumps(dp, protocol=5, buffer_callback=bufs.append), buffers=bufs)
    assert out.batch["t"].dtype == torch.bfloat16 and out.batch["t"].shape == (3, 7)
    assert torch.equal(out.batch["t"].view(torch.int16), t.view(torch.int16))
    assert out.batch["z"].shape == (3, 0)


def test_pickle_edge_cases():
    assert_same(pickle.loads(pickle.dumps(DataProto())), DataProto())
    meta_only = DataProto(meta_info={"k": 1})
    assert pickle.loads(pickle.dumps(meta_only, protocol=5)).meta_info == {"k": 1}
    empty_chunk = make(2).chunk(4)[3]
    assert_same(pickle.loads(pickle.dumps(empty_chunk, protocol=5)), empty_chunk)
    no_keys = DataProto(batch=TensorDict({}, batch_size=[3]))
    assert len(pickle.loads(pickle.dumps(no_keys))) == 3
    nested = TensorDict({}, batch_size=[2])
    nested.set(("obs", "pos"), torch.arange(6).reshape(2, 3))
    out = pickle.loads(pickle.dumps(DataProto(batch=nested), protocol=5))
    assert torch.equal(out.batch["obs", "pos"], nested["obs", "pos"])


def test_requires_grad_is_detached_in_pickling():
    w = torch.randn(4, 2, requires_grad=True)
    dp = DataProto.from_dict({"w": w * 2})
    out = pickle.loads(pickle.dumps(dp, protocol=5))
    assert not out.batch["w"].requires_grad
    assert torch.equal(out.batch["w"], (w * 2).detach())


# ----------------------------------------------------------------------- verl's helpers
def test_none_columns_and_meta_mean_empty():
    labels = np.array(["a", "b"], dtype=object)
    assert len(DataProto(batch=None, non_tensor_batch={"l": labels}, meta_info=None)) == 2
    empty = DataProto(batch=None, non_tensor_batch=None, meta_info=None)
    assert (len(empty), empty.non_tensor_batch, empty.meta_info) == (0, {}, {})


def test_sample_level_repeat_and_padding():
    dp = make(3)
    out = dp.sample_level_repeat(torch.tensor([2, 0, 1]))
    assert rows(out) == ([0, 0, 2], ["u0", "u0", "u2"]) and out.meta_info == dp.meta_info
    assert rows(dp.sample_level_repeat([1, 1, 1])) == rows(dp)
    with pytest.raises(ValueError, match="one count per row"):
        dp.sample_level_repeat([1, 2])
    padded = make(3)
    padded.padding(2)  # in place, copies of the last row
    assert rows(padded) == ([0, 1, 2, 2, 2], ["u0", "u1", "u2", "u2", "u2"])
    padded.padding(1, padding_candidate="first")
    assert rows(padded)[0][-1] == 0
    padded.padding(0)
    assert len(padded) == 6


def test_unfold_column_chunks():
    dp = DataProto.from_dict(
        {"a": torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), "b": torch.tensor([[1], [2]])},
        {"tag": np.array([["p", "q"], ["r", "s"]], dtype=object), "uid": ["u0", "u1"]},
        meta_info={"k": 1},
    )
    out = dp.unfold_column_chunks(2, split_keys=["a", "tag"])
    assert out.batch["a"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert out.batch["b"].tolist() == [[1], [1], [2], [2]]
    assert out.non_tensor_batch["tag"].tolist() == [["p"], ["q"], ["r"], ["s"]]
    assert out.non_tensor_batch["uid"].tolist() == ["u0", "u0", "u1", "u1"] and out.meta_info == {"k": 1}
    with pytest.raises(ValueError, match="does not split into 3"):
        dp.unfold_column_chunks(3, split_keys=["a"])
    with pytest.raises(KeyError):
        dp.unfold_column_chunks(2, split_keys=["nope"])


def test_tensordict_round_trip_keeps_nested_values():
    dp = DataProto.from_dict(
        {"x": torch.arange(3)},
        {"turns": [[], [0.5, 0.8], [0.9]], "info": [{"acc": 1.0}, {"acc": 0.0}, {}]},
        meta_info={"step": 7},
    )
    td = dp.to_tensordict()
    assert td.batch_size == torch.Size([3]) and td["step"] == 7
    assert list(td["turns"][1]) == [0.5, 0.8] and dict(td["info"][0]) == {"acc": 1.0}
    back = DataProto.from_tensordict(td)
    assert torch.equal(back.batch["x"], dp.batch["x"]) and back.meta_info == {"step": 7}
    assert [list(t) for t in back.non_tensor_batch["turns"]] == [[], [0.5, 0.8], [0.9]]
    assert list(back.non_tensor_batch["info"]) == [{"acc": 1.0}, {"acc": 0.0}, {}]
    with pytest.raises(ValueError, match="also earlier columns"):
        DataProto.from_dict({"x": torch.arange(1)}, meta_info={"x": 1}).to_tensordict()


def test_auto_padding_flag_is_accepted_and_subclasses_are_kept():
    class Sub(DataProto):
        pass

    assert type(Sub.from_single_dict({"x": torch.zeros(2)}, auto_padding=True)) is Sub
    assert len(DataProto.from_dict({"x": torch.zeros(2)}, auto_padding=False)) == 2
