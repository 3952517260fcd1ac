"""spmdcall.compat.verl: a verl-style driver runs after changing only its imports.

VERL_DRIVER below is written against verl's single-controller API (its own imports). The test
rewrites nothing but those import lines to ``spmdcall.compat.verl`` and runs the result, unchanged
otherwise, on the process and ray backends. The other tests pin down the verl behaviours the compat
layer adds on top of spmdcall (execute_all splitting, async methods, verl's defaults).
"""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
import warnings

import pytest

import spmdcall as sc
from spmdcall.compat import verl

pytestmark = pytest.mark.timeout(180)

VERL_DRIVER = '''
"""A PPO-shaped verl driver: roles on one pool, DataProto in and out, colocated actor + critic."""
import asyncio

import ray
import torch

from verl import DataProto
from verl.protocol import pad_dataproto_to_divisor, unpad_dataproto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, Execute, register
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
)


@ray.remote
class ActorRollout(Worker):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.seed = None
        self.updates = 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        torch.manual_seed(self.config["seed"] + self.rank)
        return self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        responses = prompts.batch["prompts"] * 10 + self.rank
        return DataProto.from_dict({"prompts": prompts.batch["prompts"], "responses": responses},
                                   {"uid": prompts.non_tensor_batch["uid"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"old_log_probs": -data.batch["responses"].float() / 100})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        self.updates += 1
        rows = torch.full((len(data),), self.rank)
        return DataProto.from_dict({"trained_on_rank": rows}, meta_info={"metrics": {"actor/rows": len(data)}})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def save_checkpoint(self, path):
        return f"rank {self.rank} saved {self.updates} updates to {path}"

    def set_seed(self, seed):
        self.seed = seed
        return (self.rank, seed)


@ray.remote
class Critic(Worker):
    def __init__(self, config):
        super().__init__()
        self.bias = config["bias"]

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    async def compute_values(self, data: DataProto) -> DataProto:
        await asyncio.sleep(0)
        return DataProto.from_dict({"values": data.batch["responses"].float() + self.bias})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update_critic(self, data: DataProto):
        return {"critic/rows": len(data), "rank": self.rank}


def main():
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False)
    actor_cls = RayClassWithInitArgs(cls=ActorRollout, config={"seed": 1})
    critic_cls = RayClassWithInitArgs(cls=Critic, config={"bias": 0.5})

    # Separate groups on one pool.
    actor_wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=actor_cls, device_name="cpu")
    critic_wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=critic_cls, device_name="cpu")
    assert actor_wg.world_size == 2
    assert actor_wg.init_model() == [0, 1]

    prompts = DataProto.from_dict({"prompts": torch.arange(5)}, {"uid": [f"p{i}" for i in range(5)]})
    future = actor_wg.generate_sequences(prompts)             # blocking=False: a future
    batch = future.get()
    assert batch.batch["responses"].tolist() == [0, 10, 20, 31, 41]   # 5 rows on 2 ranks: padded, unpadded
    assert list(batch.non_tensor_batch["uid"]) == ["p0", "p1", "p2", "p3", "p4"]

    # The way verl's trainer pads before dispatching, kept working.
    padded, pad_size = pad_dataproto_to_divisor(batch, actor_wg.world_size)
    assert (len(padded), pad_size) == (6, 1)
    log_probs = unpad_dataproto(actor_wg.compute_log_prob(padded), pad_size=pad_size)
    batch = batch.union(log_probs)
    assert len(batch) == 5

    values = critic_wg.compute_values(batch)
    batch = batch.union(values)
    assert batch.batch["values"].tolist() == [0.5, 10.5, 20.5, 31.5, 41.5]

    out = actor_wg.update_actor(batch)
    assert out.batch["trained_on_rank"].tolist() == [0, 0, 0, 1, 1]
    assert actor_wg.save_checkpoint("/tmp/ckpt") == "rank 0 saved 1 updates to /tmp/ckpt"
    assert critic_wg.update_critic(batch) == [{"critic/rows": 3, "rank": 0}, {"critic/rows": 3, "rank": 1}]

    # verl's execute_all: list arguments of length world_size are split across the ranks.
    assert actor_wg.execute_all_sync("set_seed", [7, 8]) == [(0, 7), (1, 8)]
    assert actor_wg.execute_all_sync("set_seed", 9) == [(0, 9), (1, 9)]
    assert actor_wg.execute_rank_zero_sync("set_seed", 3) == (0, 3)

    # Colocated roles: one process per rank holds both.
    class_dict = {"actor": actor_cls, "critic": critic_cls}
    fused_cls = create_colocated_worker_cls(class_dict=class_dict)
    wg_dict = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=fused_cls, device_name="cpu")
    spawned = wg_dict.spawn(prefix_set=class_dict.keys())
    colocated_actor, colocated_critic = spawned["actor"], spawned["critic"]
    colocated_actor.init_model()
    colocated_batch = colocated_actor.generate_sequences(prompts).get()
    assert torch.equal(colocated_batch.batch["responses"], batch.batch["responses"])
    colocated_values = colocated_critic.compute_values(colocated_batch)
    assert torch.equal(colocated_values.batch["values"], values.batch["values"])
    assert colocated_actor.execute_all_sync("set_seed", [1, 2]) == [(0, 1), (1, 2)]

    for wg in (actor_wg, critic_wg, wg_dict):
        wg.shutdown()
    print("verl-style driver: ok")


if __name__ == "__main__":
    main()
'''

_VERL_IMPORT = re.compile(r"^from verl(\.[\w.]+)? import (\([^)]*\)|[^\n]*)$", re.MULTILINE)


def to_spmdcall(source: str) -> str:
    """Rewrite every ``from verl... import ...`` statement to import from spmdcall.compat.verl."""
    return _VERL_IMPORT.sub(lambda m: f"from spmdcall.compat.verl import {m.group(2)}", source)


def test_only_import_lines_change():
    converted = to_spmdcall(VERL_DRIVER)
    assert "verl." not in converted.replace("spmdcall.compat.verl", "")
    changed = [(a, b) for a, b in zip(VERL_DRIVER.splitlines(), converted.splitlines()) if a != b]
    assert len(VERL_DRIVER.splitlines()) == len(converted.splitlines())
    assert changed and all(
        a.startswith("from verl") and b.startswith("from spmdcall.compat.verl import") for a, b in changed
    )


def test_verl_driver_runs_unchanged(process_backend, tmp_path, capsys):
    script = tmp_path / "verl_driver.py"
    script.write_text(to_spmdcall(VERL_DRIVER))
    verl.set_default_backend(process_backend)
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        verl.set_default_backend(None)
    assert "verl-style driver: ok" in capsys.readouterr().out


# -- the verl behaviours the compat layer adds ---------------------------------------------------


class Echo(verl.Worker):
    def __init__(self, tag="echo"):
        self.tag = tag

    def echo(self, *args, **kwargs):
        return (self.rank, args, kwargs)

    @verl.register(dispatch_mode=verl.Dispatch.ONE_TO_ALL)
    async def wait_and_tag(self, x):
        import asyncio

        await asyncio.sleep(0)
        return (self.tag, x)

    @verl.register(dispatch_mode=verl.Dispatch.ONE_TO_ALL)
    async def loop_id(self):
        import asyncio

        return id(asyncio.get_running_loop())


def inline_group(cls=Echo, n=2, **kwargs) -> verl.RayWorkerGroup:
    pool = verl.RayResourcePool([n], use_gpu=False)
    return verl.RayWorkerGroup(pool, verl.RayClassWithInitArgs(cls, **kwargs), backend="inline")


def test_execute_all_splits_lists_of_world_size_like_verl():
    with inline_group() as wg:
        assert wg.execute_all_sync("echo", [1, 2], k=["a", "b"]) == [
            (0, (1,), {"k": "a"}),
            (1, (2,), {"k": "b"}),
        ]
        # Anything else goes to every rank as given: a list of another length, a tuple, a mix.
        assert wg.execute_all_sync("echo", [1, 2, 3]) == [(0, ([1, 2, 3],), {}), (1, ([1, 2, 3],), {})]
        assert wg.execute_all_sync("echo", (1, 2)) == [(0, ((1, 2),), {}), (1, ((1, 2),), {})]
        assert wg.execute_all_sync("echo", [1, 2], 5) == [(0, ([1, 2], 5), {}), (1, ([1, 2], 5), {})]


def test_execute_async_returns_futures_and_rank_zero_runs_once():
    with inline_group() as wg:
        future = wg.execute_all("echo", [1, 2])
        assert isinstance(future, verl.DataProtoFuture) and isinstance(future, sc.GroupFuture)
        assert future.get() == [(0, (1,), {}), (1, (2,), {})]
        assert wg.execute_all_async("echo", 3).get() == [(0, (3,), {}), (1, (3,), {})]
        assert wg.execute_rank_zero("echo", [1, 2]).get() == (0, ([1, 2],), {})
        assert wg.execute_rank_zero_sync("echo", 4) == (0, (4,), {})


def test_async_methods_run_on_one_loop_per_process():
    with inline_group(tag="t") as wg:
        assert wg.wait_and_tag(1) == [("t", 1), ("t", 1)]
        first, second = wg.loop_id(), wg.loop_id()
        assert first == second  # the loop is kept between calls


def test_async_method_on_process_backend():
    pool = verl.RayResourcePool([2], use_gpu=False)
    with verl.RayWorkerGroup(pool, verl.RayClassWithInitArgs(Echo, tag="p"), backend="process") as wg:
        assert wg.wait_and_tag(2) == [("p", 2), ("p", 2)]


def test_spawned_roles_keep_verl_semantics():
    fused = verl.create_colocated_worker_cls(
        {"a": verl.RayClassWithInitArgs(Echo, tag="a"), "b": verl.RayClassWithInitArgs(Echo, tag="b")}
    )
    with verl.RayWorkerGroup(verl.RayResourcePool([2], use_gpu=False), fused, backend="inline") as wg:
        views = wg.spawn(prefix_set=fused.roles.keys())
        assert all(isinstance(v, verl.RayWorkerGroup) for v in views.values())
        assert views["a"].wait_and_tag(0) == [("a", 0), ("a", 0)]
        assert views["b"].execute_all_sync("echo", [5, 6]) == [(0, (5,), {}), (1, (6,), {})]


def test_ray_remote_classes_are_unwrapped():
    ray = pytest.importorskip("ray", minversion="2.40")  # not tests/ray/ as a namespace package
    remote_cls = ray.remote(Echo)
    cls_with_init = verl.RayClassWithInitArgs(cls=remote_cls, tag="r")
    assert cls_with_init.cls is Echo and cls_with_init.kwargs == {"tag": "r"}
    fused = verl.create_colocated_worker_cls({"e": cls_with_init})
    assert fused.roles["e"].cls is Echo


def test_resource_pool_keeps_verl_defaults():
    pool = verl.RayResourcePool([2, 2])
    assert (pool.use_gpu, pool.max_colocate_count, pool.world_size) == (True, 10, 4)
    assert isinstance(pool, sc.ResourcePool)
    with pytest.raises(TypeError, match="process_on_nodes"):
        verl.RayResourcePool()
    with pytest.warns(UserWarning, match="accelerator_type"):
        verl.RayResourcePool([1], accelerator_type="H100")


def test_ignored_verl_options_warn():
    pool = verl.RayResourcePool([1], use_gpu=False)
    with pytest.warns(UserWarning, match="profile_steps"):
        verl.RayWorkerGroup(
            pool, verl.RayClassWithInitArgs(Echo), backend="inline", profile_steps=[1]
        ).shutdown()
    with pytest.warns(UserWarning, match="update_options"):
        verl.RayClassWithInitArgs(Echo).update_options({"num_cpus": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # verl's usual arguments pass silently
        verl.RayWorkerGroup(
            pool,
            verl.RayClassWithInitArgs(Echo),
            backend="inline",
            device_name="cuda",
            name_prefix="echo",
            use_gpu=False,
        ).shutdown()
    with pytest.raises(TypeError, match="from_detached"):
        verl.RayWorkerGroup(pool, verl.RayClassWithInitArgs(Echo), worker_names=["a"])
    # What a backend takes is what it declares (capabilities.detached), not what its name suggests.
    with pytest.raises(ValueError, match=r"a backend that takes detached= \(ray does\); .* on 'process'"):
        verl.RayWorkerGroup(pool, verl.RayClassWithInitArgs(Echo), backend="process", detached=True)


def test_default_backend_follows_set_default_backend():
    try:
        verl.set_default_backend("inline")
        with verl.RayWorkerGroup(
            verl.RayResourcePool([1], use_gpu=False), verl.RayClassWithInitArgs(Echo)
        ) as wg:
            assert "backend=inline" in repr(wg)
        verl.set_default_backend(None)
        assert verl.default_backend() in ("ray", "process")
        with pytest.raises(TypeError):
            verl.set_default_backend(3)
    finally:
        verl.set_default_backend(None)


def test_names_resolve_and_import_stays_light():
    for name in verl.__all__:
        assert getattr(verl, name) is not None, name
    assert verl.DataProtoFuture is sc.GroupFuture and issubclass(verl.Worker, sc.Worker)
    code = "import sys, spmdcall.compat.verl; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
