"""The dispatch-mode registry, plugin discovery through entry points, and a light `import spmdcall`."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import pytest

import spmdcall as sc
from spmdcall.group.modes import resolve_dispatch_mode


def test_builtin_modes_are_registered_by_name():
    for name in (
        "ONE_TO_ALL",
        "ALL_TO_ALL",
        "RANK_ZERO",
        "DP_COMPUTE",
        "DP_COMPUTE_PROTO",
        "DP_COMPUTE_PROTO_WITH_FUNC",
        "DP_COMPUTE_METRIC",
    ):
        assert resolve_dispatch_mode(name) is getattr(sc.Dispatch, name)
    assert sc.Dispatch.DP_COMPUTE_PROTO.splits_data and not sc.Dispatch.ONE_TO_ALL.splits_data


def test_register_dispatch_mode_validates_and_refuses_silent_overwrite():
    def d(group, *a, **k):
        return a, k

    def c(group, outputs):
        return outputs

    mode = sc.register_dispatch_mode("TEST_MODE_A", d, c)
    assert resolve_dispatch_mode("TEST_MODE_A") is mode
    assert sc.register_dispatch_mode("TEST_MODE_A", d, c).dispatch_fn is d  # same functions: fine
    with pytest.raises(ValueError, match="already registered"):
        sc.register_dispatch_mode("TEST_MODE_A", d, lambda g, o: o)
    with pytest.raises(TypeError, match="must be callable"):
        sc.register_dispatch_mode("TEST_MODE_B", d, 3)
    with pytest.raises(ValueError, match="unknown dispatch mode 'NOPE'"):
        resolve_dispatch_mode("NOPE")
    with pytest.raises(TypeError, match="'dispatch_fn' and 'collect_fn'"):
        sc.register(dispatch_mode={"dispatch_fn": d})
    with pytest.raises(ValueError, match="execute_mode"):
        sc.register(execute_mode="sometimes")


def test_registered_modes_are_dispatch_attributes_and_overwrite_in_place():
    from spmdcall.group.modes import unregister_dispatch_mode

    def d(group, *a, **k):
        return a, k

    def c(group, outputs):
        return outputs

    def c2(group, outputs):
        return outputs[::-1]

    class W:
        @sc.register(dispatch_mode=sc.register_dispatch_mode("TEST_MODE_C", d, c))
        def f(self): ...

    # As verl's Dispatch enum: a registered mode is Dispatch.<NAME> too.
    assert sc.Dispatch.TEST_MODE_C is resolve_dispatch_mode("TEST_MODE_C")
    # overwrite=True changes the one mode object, so methods declared with it follow.
    mode = sc.register_dispatch_mode("TEST_MODE_C", d, c2, overwrite=True)
    from spmdcall.group.register import method_spec, resolve_spec

    assert (
        mode is sc.Dispatch.TEST_MODE_C and resolve_spec(method_spec(W, "f")).dispatch_mode.collect_fn is c2
    )
    unregister_dispatch_mode("TEST_MODE_C")
    with pytest.raises(AttributeError):
        _ = sc.Dispatch.TEST_MODE_C
    with pytest.raises(KeyError):
        unregister_dispatch_mode("TEST_MODE_C")
    with pytest.raises(ValueError, match="built-in"):
        unregister_dispatch_mode("ONE_TO_ALL")


def test_builtin_overwrite_changes_behaviour_and_its_declarations():
    from spmdcall.group.modes import collect_all_to_all, dispatch_dp_compute_data_proto, dispatch_one_to_all

    one_to_all = sc.Dispatch.ONE_TO_ALL
    try:
        sc.register_dispatch_mode(
            "ONE_TO_ALL", dispatch_dp_compute_data_proto, collect_all_to_all, splits_data=True, overwrite=True
        )
        assert sc.Dispatch.ONE_TO_ALL is one_to_all and one_to_all.splits_data
    finally:
        sc.register_dispatch_mode("ONE_TO_ALL", dispatch_one_to_all, collect_all_to_all, overwrite=True)
    assert not one_to_all.splits_data and one_to_all.dispatch_fn is dispatch_one_to_all


def test_unregistered_public_methods_default_to_one_to_all():
    from spmdcall.group.register import method_spec, public_methods, resolve_spec

    class C:
        def a(self): ...
        @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
        def b(self, x): ...
        def _c(self): ...
        @property
        def d(self): ...

    assert resolve_spec(method_spec(C, "a")).dispatch_mode is sc.Dispatch.ONE_TO_ALL
    assert method_spec(C, "b").dispatch_mode is sc.Dispatch.DP_COMPUTE_PROTO
    assert method_spec(C, "_c") is None and method_spec(C, "d") is None
    assert public_methods(C) == ["a", "b"]


def test_import_spmdcall_loads_neither_torch_nor_ray():
    code = "import sys, spmdcall; bad = [m for m in ('torch', 'ray', 'vllm', 'tensordict', 'numpy', 'pytest', 'spmdcall.testing') if m in sys.modules]; print(bad)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"


DEFERRED_REGISTRATIONS = """
import sys
import spmdcall.data, spmdcall.compat.verl.protocol
assert "torch._dynamo" not in sys.modules, "DataProto loaded torch._dynamo"
deferred = next(f for f in sys.meta_path if type(f).__name__ == "_AfterDynamo").deferred
import torch._dynamo
from torch._dynamo import trace_rules
missing = [f for f in deferred if id(f) not in trace_rules._allowed_callable_ids]
print(len(deferred), missing)
"""


def test_data_proto_defers_tensordicts_compile_registrations_until_dynamo_loads():
    """tensordict registers functions with torch.compile when imported, which loads torch._dynamo
    (seconds per process); spmdcall.data has them registered when dynamo is loaded instead."""
    out = subprocess.run(
        [sys.executable, "-c", DEFERRED_REGISTRATIONS], capture_output=True, text=True, check=True
    ).stdout.split(maxsplit=1)
    assert int(out[0]) > 0 and out[1].strip() == "[]"


PLUGIN_PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "spmdcall-test-plugin"
version = "0.0.1"

[project.entry-points."spmdcall.dispatch_modes"]
PLUGIN_SUM = "spmdcall_test_plugin:PLUGIN_SUM"

[project.entry-points."spmdcall.backends"]
plugin-inline = "spmdcall_test_plugin:PluginBackend"
"""

PLUGIN_MODULE = '''
"""A third-party package adding a dispatch mode and a backend to spmdcall."""
from spmdcall.backends.inline import InlineBackend
from spmdcall.group.modes import dispatch_one_to_all

PLUGIN_SUM = {"dispatch_fn": dispatch_one_to_all, "collect_fn": lambda group, outputs: sum(outputs)}


class PluginBackend(InlineBackend):
    name = "plugin-inline"
'''

PLUGIN_USER = """
import spmdcall as sc

class Worker:
    @sc.register(dispatch_mode="PLUGIN_SUM")
    def value(self, x):
        return x

assert "PLUGIN_SUM" in sc.available_dispatch_modes()
assert "plugin-inline" in sc.available_backends()
with sc.WorkerGroup(sc.ResourcePool([3]), sc.ClassWithInitArgs(Worker), backend="plugin-inline") as wg:
    print(wg.value(2))
"""


@pytest.mark.timeout(300)
def test_plugin_package_installed_with_pip_adds_a_mode_and_a_backend(tmp_path):
    pkg = tmp_path / "plugin"
    pkg.mkdir()
    (pkg / "pyproject.toml").write_text(PLUGIN_PYPROJECT)
    (pkg / "spmdcall_test_plugin.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", "--no-index", str(pkg)], check=True)
    try:
        out = subprocess.run(
            [sys.executable, "-c", PLUGIN_USER], capture_output=True, text=True, cwd=tmp_path
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "6"
    finally:
        subprocess.run([*pip, "uninstall", "-y", "spmdcall-test-plugin"], check=True)


def test_a_mode_declares_what_it_does_with_data():
    """``splits_data`` and ``copies_data`` are what a mode declares (a third party's too), not
    what its functions are: a mode built on the built-in functions declares nothing by default."""
    from spmdcall.group.modes import (
        collect_dp_compute_data_proto,
        dispatch_dp_compute_data_proto,
        resolve_dispatch_mode,
        unregister_dispatch_mode,
    )

    proto = sc.Dispatch.DP_COMPUTE_PROTO
    assert (proto.splits_data, proto.copies_data) == (True, True)
    assert (sc.Dispatch.DP_COMPUTE_METRIC.splits_data, sc.Dispatch.DP_COMPUTE_METRIC.copies_data) == (
        True,
        False,
    )
    assert not sc.Dispatch.ONE_TO_ALL.splits_data and not sc.Dispatch.ONE_TO_ALL.copies_data
    try:
        plain = sc.register_dispatch_mode(
            "TEST_PLAIN", dispatch_dp_compute_data_proto, collect_dp_compute_data_proto
        )
        declared = sc.register_dispatch_mode(
            "TEST_DECLARED",
            dispatch_dp_compute_data_proto,
            collect_dp_compute_data_proto,
            splits_data=True,
            copies_data=True,
        )
        assert (plain.splits_data, plain.copies_data) == (False, False)
        assert (declared.splits_data, declared.copies_data) == (True, True)
        with pytest.raises(ValueError, match="already registered"):  # other declarations: a different mode
            sc.register_dispatch_mode(
                "TEST_PLAIN", dispatch_dp_compute_data_proto, collect_dp_compute_data_proto, splits_data=True
            )
        # The declarations travel with the mode, and a dict declares them too.
        assert pickle.loads(pickle.dumps(declared)) is declared
        as_dict = resolve_dispatch_mode(
            {
                "dispatch_fn": dispatch_dp_compute_data_proto,
                "collect_fn": collect_dp_compute_data_proto,
                "splits_data": True,
            }
        )
        assert (as_dict.splits_data, as_dict.copies_data) == (True, False)
    finally:
        unregister_dispatch_mode("TEST_PLAIN")
        unregister_dispatch_mode("TEST_DECLARED")
