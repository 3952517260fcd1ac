"""verl's API beyond the driver basics, as ``spmdcall.compat.verl`` provides it: the names verl's
own tests use (``make verl-compat`` runs those against it), each pinned down here without verl.

Pure-Python pieces run in-process; groups run on every backend where behaviour is shared, and on
Ray where it is Ray's (ObjectRefs, detached groups, GPU ids).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict")

from tensordict import TensorDict  # noqa: E402

import spmdcall as sc  # noqa: E402
from spmdcall.compat import verl  # noqa: E402
from spmdcall.compat.verl.shim import MODULES, write_shim  # noqa: E402

pytestmark = pytest.mark.timeout(180)


# -- the re-export package -----------------------------------------------------------------------


def test_shim_modules_are_re_exports(tmp_path):
    write_shim(tmp_path)
    code = (
        "import importlib, spmdcall.compat.verl as compat\n"
        "import verl.single_controller.base.decorator\n"
        f"modules = {MODULES!r}\n"
        "for name, attrs in modules.items():\n"
        "    module = importlib.import_module(name)\n"
        "    assert set(module.__all__) == {a for a in attrs if not a.startswith('_')}\n"
        "    for attr in attrs:\n"
        "        assert getattr(module, attr) is getattr(compat, attr), (name, attr)\n"
        "print(verl.single_controller.base.decorator.DISPATCH_MODE_FN_REGISTRY is compat.DISPATCH_MODE_FN_REGISTRY)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd()]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"  # the registry verl code clears and restores is spmdcall's


# -- verl.protocol's helpers ---------------------------------------------------------------------


def test_union_helpers_compare_like_verl():
    obs = torch.randn(4, 2)
    td = TensorDict({"obs": obs}, [4])
    assert set(verl.union_tensor_dict(td, TensorDict({"obs": obs, "r": torch.ones(4)}, [4])).keys()) == {
        "obs",
        "r",
    }
    with pytest.raises(AssertionError, match="not the same object"):  # a DataProtoError: ValueError too
        verl.union_tensor_dict(td, TensorDict({"obs": obs + 1}, [4]))
    nan = np.array([1.0, np.nan])
    assert verl.union_numpy_dict({"a": nan}, {"a": nan.copy(), "b": nan})["b"] is nan
    with pytest.raises(ValueError, match="`a` in tensor_dict1"):
        verl.union_numpy_dict({"a": nan}, {"a": np.array([np.nan, 1.0])})
    nested = np.array([np.array([1, 2]), "x", None], dtype=object)
    verl.union_numpy_dict({"a": nested}, {"a": nested.copy()})
    with pytest.raises(ValueError):
        verl.union_numpy_dict({"a": nested}, {"a": np.array([np.array([1, 3]), "x", None], dtype=object)})
    cycle_a, cycle_b, flat = (np.array([None], dtype=object) for _ in range(3))
    cycle_a[0], cycle_b[0] = cycle_a, cycle_b
    verl.union_numpy_dict({"c": cycle_a}, {"c": cycle_b})  # a cycle meets itself: equal there
    with pytest.raises(ValueError):
        verl.union_numpy_dict({"c": cycle_a}, {"c": flat})


def test_fold_and_unfold_batch_dim():
    dp = sc.DataProto.from_dict({"x": torch.arange(6)}, {"tag": list("abcdef")}, {"k": 1})
    folded = verl.fold_batch_dim(dp, new_batch_size=3)
    assert folded.batch["x"].tolist() == [[0, 1], [2, 3], [4, 5]] and folded.non_tensor_batch[
        "tag"
    ].shape == (3, 2)
    folded.reorder(torch.tensor([2, 0, 1]))
    back = verl.unfold_batch_dim(folded, batch_dims=2)
    assert back.batch["x"].tolist() == [4, 5, 0, 1, 2, 3] and list(back.non_tensor_batch["tag"]) == list(
        "efabcd"
    )
    assert back.meta_info == {"k": 1}
    with pytest.raises(ValueError, match="do not fold"):
        verl.fold_batch_dim(dp, 4)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_serialization_round_trips_every_dtype_and_nested_tensors():
    dtypes = [torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.float8_e5m2]
    for dtype in dtypes:
        t = torch.arange(6).reshape(2, 3).to(dtype)
        name, shape, data = verl.serialize_single_tensor(t)
        back = verl.deserialize_single_tensor((name, shape, data))
        assert back.dtype == dtype and back.shape == t.shape and torch.equal(back.float(), t.float())
        back.view(torch.uint8)[0] = 0  # writable memory of its own
        assert torch.equal(t.float(), torch.arange(6).reshape(2, 3).to(dtype).float())
    assert verl.deserialize_single_tensor(verl.serialize_single_tensor(torch.zeros(0, 3))).shape == (0, 3)
    nested = torch.nested.as_nested_tensor([torch.ones(2, 3), torch.zeros(1, 3)])
    td = TensorDict({"n": nested, "x": torch.arange(2)}, batch_size=[2], device="cpu")
    back = verl.deserialize_tensordict(verl.serialize_tensordict(td))
    assert back.batch_size == td.batch_size and str(back.device) == "cpu"
    assert [r.tolist() for r in back["n"].unbind()] == [r.tolist() for r in nested.unbind()]


def test_auto_padding_is_always_on():
    assert verl.DataProtoConfig.auto_padding
    with pytest.warns(UserWarning, match="no effect"):
        verl.DataProtoConfig.auto_padding = False
    assert verl.DataProtoConfig.auto_padding
    data = verl.DataProto.from_dict({"a": torch.zeros(5)}, auto_padding=True)
    data.padding(3)
    assert len(data) == 8 and all(len(c) == 2 for c in data.chunk(4))


# -- verl's decorator module ---------------------------------------------------------------------


class Echo(verl.Worker):
    def __init__(self, tag="e"):
        super().__init__()
        self.tag = tag

    @verl.register(dispatch_mode=verl.Dispatch.ONE_TO_ALL)
    def echo(self, x):
        return (self.rank, x)

    @verl.register(dispatch_mode=verl.Dispatch.ALL_TO_ALL, execute_mode=verl.Execute.RANK_ZERO)
    def add_on_zero(self, x, y):
        return (self.rank, x + y)

    def getenv(self, key):
        return os.environ.get(key)


def inline_group(cls=Echo, n=2, **kwargs):
    return verl.RayWorkerGroup(
        verl.RayResourcePool([n], use_gpu=False), verl.RayClassWithInitArgs(cls, **kwargs), backend="inline"
    )


def test_dispatch_registry_like_verls():
    registry = verl.DISPATCH_MODE_FN_REGISTRY
    snapshot = registry.copy()

    def first(group, *args, **kwargs):
        return tuple([a] + [None] * (group.world_size - 1) for a in args), {}

    def reverse(group, outputs):
        return outputs[::-1]

    try:
        verl.register_dispatch_mode("VERL_TEST_MODE", first, reverse)
        verl._check_dispatch_mode(verl.Dispatch.VERL_TEST_MODE)
        assert verl.get_predefined_dispatch_fn(verl.Dispatch.VERL_TEST_MODE) == {
            "dispatch_fn": first,
            "collect_fn": reverse,
        }
        # Updating a built-in mode reaches methods declared with it, as verl's registry does.
        with inline_group() as wg:
            verl.update_dispatch_mode(verl.Dispatch.ONE_TO_ALL, first, reverse)
            assert wg.echo(5) == [(1, None), (0, 5)]
        verl.Dispatch.remove("VERL_TEST_MODE")
        with pytest.raises(AttributeError):
            _ = verl.Dispatch.VERL_TEST_MODE
        with pytest.raises(TypeError):
            verl._check_dispatch_mode("ONE_TO_ALL")
    finally:
        registry.clear()
        registry.update(snapshot)
    assert registry.copy() == snapshot and verl.Dispatch.ONE_TO_ALL.collect_fn is verl.collect_all_to_all
    with inline_group() as wg:
        assert wg.echo(5) == [(0, 5), (1, 5)]


def test_all_to_all_on_rank_zero_takes_arguments_as_given():
    with inline_group() as wg:
        assert wg.add_on_zero(x=1, y=2) == (0, 3)  # verl: rank 0 gets them as they are
        assert wg.execute_func_rank_zero(lambda a, b: a * b, 6, 7) == 42

        def tag_rows(worker, data):
            return verl.DataProto.from_dict({"rank": torch.full((len(data),), worker.rank)})

        out = wg.execute_with_func_generator(tag_rows, verl.DataProto.from_dict({"x": torch.zeros(3)}))
        assert out.batch["rank"].tolist() == [0, 0, 1]


# -- verl's worker -------------------------------------------------------------------------------


def test_worker_side_api(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    for key, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "9",
    }.items():
        monkeypatch.setenv(key, value)
    ref, actor, both = verl.Worker(), verl.Worker(cuda_visible_devices="3"), verl.Worker()
    assert (actor._rank, actor._world_size, actor.get_master_addr_port()) == (1, 2, ("h", "9"))
    ref._register_dispatch_collect_info("ref", dp_rank=0, is_collect=True)
    actor._register_dispatch_collect_info("actor", dp_rank=1, is_collect=False)
    with pytest.raises(ValueError, match="has been registered"):
        actor._register_dispatch_collect_info("actor", dp_rank=0, is_collect=True)
    both.set_dispatch_collect("ref", **ref.get_dispatch_collect())
    both.set_dispatch_collect("actor", **actor.get_dispatch_collect())
    assert (both._query_dispatch_info("ref"), both._query_collect_info("ref")) == (0, True)
    assert (both._query_dispatch_info("actor"), both.query_collect_info("actor")) == (1, False)
    with pytest.raises(AssertionError):  # verl asserts here; a MeshRegistrationError is both
        both.set_dispatch_collect("actor", **actor.get_dispatch_collect())
    assert actor.get_cuda_visible_devices() == "3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert actor.get_cuda_visible_devices() == "not set"


# -- groups on every backend ---------------------------------------------------------------------


class Meshed(verl.Worker):
    """Ranks (r) in a dp x tp = (world // 2) x 2 mesh "tp2", and every rank its own dp in "dp"."""

    def __init__(self):
        super().__init__()
        self._register_dispatch_collect_info("tp2", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)
        self._register_dispatch_collect_info("dp", dp_rank=self.rank, is_collect=True)

    @verl.register(dispatch_mode=verl.make_nd_compute_dataproto_dispatch_fn("tp2"))
    def stamp(self, data):
        data.batch["rank"] = torch.full((len(data),), self.rank)
        return data

    @verl.register(dispatch_mode=verl.make_nd_compute_dataproto_dispatch_fn("dp"), blocking=False)
    def stamp_td(self, td):
        assert [len(r) for r in td["ids"].unbind(0)] == [2 * self.rank + 1, 2 * self.rank + 2]
        return TensorDict({"ids": td["ids"] + self.rank, "rank": torch.full((2,), self.rank)}, batch_size=[2])


def test_mesh_dispatch_splits_over_dp_and_collects_the_reporting_ranks(backend):
    pool = verl.RayResourcePool([4], use_gpu=False)
    with verl.RayWorkerGroup(pool, verl.RayClassWithInitArgs(Meshed), backend=backend) as wg:
        out = wg.stamp(verl.DataProto.from_dict({"x": torch.arange(5)}))  # 5 rows, dp 2: padded, unpadded
        assert out.batch["x"].tolist() == [0, 1, 2, 3, 4] and out.batch["rank"].tolist() == [0, 0, 0, 2, 2]
        assert wg._dispatch_info["tp2"] == [0, 0, 1, 1] and wg._collect_info["tp2"] == [
            True,
            False,
            True,
            False,
        ]
        ids = torch.nested.as_nested_tensor([torch.arange(n) for n in range(1, 9)], layout=torch.jagged)
        result = wg.stamp_td(TensorDict({"ids": ids}, batch_size=[8])).get()
        assert isinstance(result, TensorDict) and result["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        assert [row.tolist() for row in result["ids"].unbind(0)][3] == [1, 2, 3, 4]  # row 3: rank 1's
        six = torch.nested.as_nested_tensor([torch.arange(n) for n in range(1, 7)], layout=torch.jagged)
        with pytest.raises(ValueError, match="does not split into 4"):
            wg.stamp_td(TensorDict({"ids": six}, batch_size=[6]))


class Adder(verl.Worker):
    @verl.register(dispatch_mode=verl.Dispatch.ONE_TO_ALL)
    def add(self, x):
        return x + self.rank


class Subber(verl.Worker):
    def __init__(self, val):
        super().__init__()
        self.val = val

    @verl.register(dispatch_mode=verl.Dispatch.ALL_TO_ALL)
    def sub(self, x):
        return x - self.val


def test_fused_worker_class_with_its_own_methods(backend):
    roles = {"actor": verl.RayClassWithInitArgs(Adder), "critic": verl.RayClassWithInitArgs(Subber, val=10)}
    fused_cls = verl.create_colocated_worker_raw_cls(roles)
    hybrid = type(
        "Hybrid",
        (fused_cls,),
        {"both": verl.register(verl.Dispatch.ONE_TO_ALL)(lambda self, x: self.critic.sub(self.actor.add(x)))},
    )
    pool = verl.RayResourcePool([2], use_gpu=False)
    with verl.RayWorkerGroup(pool, verl.RayClassWithInitArgs(hybrid), backend=backend) as wg:
        wg.fuse(roles.keys())
        assert wg.actor.add(1) == [1, 2] and wg.critic.sub([1, 2]) == [-9, -8]
        assert wg.both(1) == [-9, -8]
        assert set(wg.spawn(["critic"])) == {"critic"}


def test_worker_env_refuses_what_spmdcall_sets_and_adds_ray_local_world_size(process_backend):
    pool = verl.RayResourcePool([2], use_gpu=False)
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        verl.RayWorkerGroup(
            pool, verl.RayClassWithInitArgs(Echo), backend=process_backend, worker_env={"WORLD_SIZE": "9"}
        )
    with verl.RayWorkerGroup(
        pool, verl.RayClassWithInitArgs(Echo), backend=process_backend, worker_env={"MY_KEY": "v"}
    ) as wg:
        env = wg.execute_all_sync("getenv", ["MY_KEY", "RAY_LOCAL_WORLD_SIZE"])
        assert wg.execute_all_sync("getenv", "MY_KEY") == ["v", "v"] and env == ["v", "2"]
        assert len(wg.worker_names) == 2 and len(set(wg.worker_names)) == 2


def test_split_and_merge_resource_pools_keep_verls_pool_type():
    pool = verl.RayResourcePool([2, 2], max_colocate_count=3)
    parts = verl.split_resource_pool(pool, split_size=1)
    assert [p.world_size for p in parts] == [1, 1, 1, 1] and all(
        isinstance(p, verl.RayResourcePool) for p in parts
    )
    merged = verl.merge_resource_pool(parts[3], parts[0])
    assert merged.world_size == 2 and merged.store == [1, 1] and merged.max_colocate_count == 3
    assert verl.RayResourcePool([2]).get_placement_groups() == []  # nothing placed while no group runs
    with pytest.raises(ValueError, match="detached"):
        verl.merge_resource_pool(verl.RayResourcePool([1], detached=True), verl.RayResourcePool([1]))


# -- Ray -----------------------------------------------------------------------------------------


def test_non_blocking_calls_return_object_refs_on_ray(ray_session):
    ray = ray_session
    with verl.RayWorkerGroup(verl.RayResourcePool([2]), verl.RayClassWithInitArgs(Echo), backend="ray") as wg:
        refs = wg.execute_all_async("echo", 3)
        assert isinstance(refs, list) and all(isinstance(r, ray.ObjectRef) for r in refs)
        assert ray.get(refs) == [(0, 3), (1, 3)] and refs.get() == ray.get(refs)
        assert ray.get(wg.execute_rank_zero_async("echo", 4)) == (0, 4)
        # ObjectRefs go back in as values: Ray resolves them on the workers.
        assert wg.execute_all_sync("echo", refs) == [(0, (0, 3)), (1, (1, 3))]
        assert wg.echo(ray.put("v")) == [(0, "v"), (1, "v")]
        # GPUs as Ray bookkeeping (the session has 2 logical GPUs): each rank's own id.
        assert sorted(wg.execute_all_sync("get_cuda_visible_devices")) == ["0", "1"]
        assert len(wg.resource_pool.get_placement_groups()) == 1
        assert all(name.startswith(wg.name) for name in wg.worker_names)


def test_object_refs_reach_workers_of_other_backends_as_values(ray_session):
    ray = ray_session
    with inline_group() as wg:
        assert wg.echo(ray.put(1)) == [(0, 1), (1, 1)]
        assert wg.execute_all_sync("echo", [ray.put("a"), ray.put("b")]) == [(0, "a"), (1, "b")]


def test_from_detached_reaches_a_detached_group(ray_session):
    pool = verl.RayResourcePool([2], use_gpu=False)
    with verl.RayWorkerGroup(
        pool, verl.RayClassWithInitArgs(Echo, tag="d"), name_prefix="verl-det", detached=True
    ) as wg:
        again = verl.RayWorkerGroup.from_detached(worker_names=wg.worker_names)
        assert isinstance(again, verl.RayWorkerGroup) and again.add_on_zero(x=1, y=2) == (0, 3)
    with verl.RayWorkerGroup(pool, verl.RayClassWithInitArgs(Echo), backend="ray") as plain:
        with pytest.raises(ValueError, match="detached=True"):
            verl.RayWorkerGroup.from_detached(worker_names=plain.worker_names)


def test_no_warning_for_verls_usual_arguments():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        verl.RayWorkerGroup(
            verl.RayResourcePool([1], use_gpu=False),
            verl.RayClassWithInitArgs(Echo),
            backend="inline",
            device_name="cpu",
        ).shutdown()
