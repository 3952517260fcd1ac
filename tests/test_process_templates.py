"""Ranks forked from a warm template (the process backend's default start): what each rank gets of its
own, what the template imports, and how templates are replaced, retired and ended."""

from __future__ import annotations

import logging
import os
import signal
import sys
import textwrap
import time

import pytest
from procs import alive, run_controller, wait_gone

import spmdcall as sc

pytestmark = pytest.mark.timeout(180)


class Probe(sc.Worker):
    def __init__(self, marker="xml.dom.minidom"):
        self.had_marker = marker in sys.modules  # before this rank imported it (below)
        __import__(marker)

    def where(self):
        return {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "session": os.getsid(0),
            "cmdline": open("/proc/self/cmdline").read().replace("\0", " ").strip(),
            "rank": os.environ["RANK"],
            "world_size": os.environ["WORLD_SIZE"],
            "omp": os.environ["OMP_NUM_THREADS"],
            "cwd": os.getcwd(),
            "extra": os.environ.get("SPMD_TEMPLATE_TEST"),
        }

    def had_marker_before_init(self):
        return self.had_marker

    def shout(self, text):
        print(f"rank {self.rank}: {text}", flush=True)

    def torch_threads(self):
        import torch

        return torch.get_num_threads()

    def numpy_draw(self):
        import numpy as np

        return float(np.random.random())


class Other(sc.Worker):
    def title(self):
        return open("/proc/self/cmdline").read().replace("\0", " ").strip()


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read().replace("\0", " ").strip()


def _group(**options) -> sc.WorkerGroup:
    return sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Probe), **options)


def test_groups_of_one_environment_fork_from_its_template():
    with _group() as first:
        first.where()
    with _group() as second:  # its template holds what the first group's ranks imported by now
        a = second.where()
    with _group() as third:  # ... and nothing more was learned since: the same template
        b = third.where()
    template = a[0]["ppid"]
    assert {w["ppid"] for w in a + b} == {template}, "every rank is forked by the same template"
    assert template != os.getpid()
    assert _cmdline(template) == "spmdcall template"
    with _group(env={"SPMD_TEMPLATE_TEST": "other"}) as other:  # another environment: another template
        c = other.where()
    assert [w["extra"] for w in c] == ["other", "other"]
    assert {w["ppid"] for w in c} != {template}


def test_each_rank_is_named_by_its_class_and_rank_and_has_its_own_session():
    with _group() as wg:
        where = wg.where()
    assert [w["cmdline"] for w in where] == ["spmdcall Probe 0/2", "spmdcall Probe 1/2"]
    assert all(w["session"] == w["pid"] for w in where), "each rank leads a session of its own"
    both = sc.colocate({"probe": sc.ClassWithInitArgs(Probe), "other": sc.ClassWithInitArgs(Other)})
    with sc.WorkerGroup(sc.ResourcePool([2]), both) as wg:
        views = wg.spawn({"probe", "other"})
        assert views["other"].title() == ["spmdcall Probe+Other 0/2", "spmdcall Probe+Other 1/2"]


def test_each_rank_takes_its_environment_after_the_fork(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # after the template was made (an earlier test made it)
    with _group() as wg:
        where = wg.where()
        assert [w["rank"] for w in where] == ["0", "1"]
        assert [w["world_size"] for w in where] == ["2", "2"]
        assert [w["cwd"] for w in where] == [str(tmp_path)] * 2
        # torch loaded in the template (an earlier group's ranks imported it): its thread count
        # follows each rank's OMP_NUM_THREADS, as it does in a fresh interpreter.
        assert wg.torch_threads() == [int(w["omp"]) for w in where]
        draws = wg.numpy_draw()
        assert draws[0] != draws[1], "each rank has its own unseeded numpy stream"
        wg.shout("hello")
    out = capfd.readouterr().out
    assert "rank 0: hello" in out and "rank 1: hello" in out  # the controller's stdout of this moment


def test_what_ranks_import_while_they_build_is_in_the_next_groups_template():
    marker = "xml.sax.saxutils"  # a library module that nothing in a rank imports otherwise
    probe = sc.ClassWithInitArgs(Probe, marker=marker)
    with sc.WorkerGroup(sc.ResourcePool([2]), probe) as wg:
        assert wg.had_marker_before_init() == [False, False]
    with sc.WorkerGroup(sc.ResourcePool([2]), probe) as wg:
        assert wg.had_marker_before_init() == [True, True]


def test_restart_forks_the_rank_again():
    with _group() as wg:
        before = wg.where()
        os.kill(before[1]["pid"], signal.SIGKILL)
        with pytest.raises(sc.WorkerDiedError, match="killed by SIGKILL"):
            wg.where()
        wg.restart()
        after = wg.where()
    assert after[0]["pid"] == before[0]["pid"] and after[1]["pid"] != before[1]["pid"]
    assert _cmdline(after[1]["ppid"]) == "spmdcall template" and after[1]["cmdline"] == "spmdcall Probe 1/2"


def test_spawn_starts_fresh_interpreters_as_before():
    with _group(start_method="spawn") as wg:
        where = wg.where()
        assert wg.had_marker_before_init() == [False, False]
    assert {w["ppid"] for w in where} == {os.getpid()}
    assert [w["cmdline"] for w in where] == ["spmdcall Probe 0/2", "spmdcall Probe 1/2"]


@pytest.mark.parametrize(
    "options, error, match",
    [
        (
            {"start_method": "fork"},
            ValueError,
            r"start_method must be one of \['template', 'spawn'\], got 'fork'",
        ),
        ({"preload": "torch"}, TypeError, r"preload must be a list of module names, got 'torch'"),
        ({"preload": ["torch", 3]}, TypeError, r"preload must be a list of module names, got \['torch', 3\]"),
    ],
)
def test_bad_start_options_are_refused(options, error, match):
    with pytest.raises(error, match=match):
        _group(**options)


def _module(tmp_path, monkeypatch, name: str, source: str):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return __import__(name)


def test_a_module_that_fails_to_import_in_the_ranks_gives_the_ranks_error(tmp_path, monkeypatch):
    mod = _module(
        tmp_path,
        monkeypatch,
        "template_breaks_here",
        """
        import os
        if os.environ.get("SPMD_TEMPLATE_TEST") == "break":
            raise RuntimeError("this module does not import with SPMD_TEMPLATE_TEST=break")
        class W:
            def ping(self):
                return "pong"
        """,
    )
    with pytest.raises(sc.WorkerError, match="does not import with SPMD_TEMPLATE_TEST=break") as info:
        sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(mod.W), env={"SPMD_TEMPLATE_TEST": "break"})
    assert info.value.method == "__init__"
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(mod.W)) as wg:
        assert wg.ping() == ["pong", "pong"]


def test_a_module_that_starts_a_thread_is_imported_by_the_ranks_themselves(tmp_path, monkeypatch, caplog):
    mod = _module(
        tmp_path,
        monkeypatch,
        "template_starts_a_thread",
        """
        import threading, time
        TICKER = threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="ticker")
        TICKER.start()
        class W:
            def ticking(self):
                return TICKER.is_alive()
        """,
    )
    with caplog.at_level(logging.WARNING, logger="spmdcall"):
        with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(mod.W)) as wg:
            assert wg.ticking() == [True, True]  # each rank's own thread, started after its fork
        with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(mod.W)) as wg:
            assert wg.ticking() == [True, True]
    warnings = [r.getMessage() for r in caplog.records if "template_starts_a_thread" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "started a thread (ticker)" in warnings[0]


def test_an_edited_module_gets_a_fresh_template(tmp_path, monkeypatch):
    source = """
    class W:
        def version(self):
            return {version}
    """
    mod = _module(tmp_path, monkeypatch, "template_edited", source.format(version=1))
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(mod.W)) as wg:
        assert wg.version() == [1, 1]
    path = tmp_path / "template_edited.py"
    path.write_text(textwrap.dedent(source.format(version=2)))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime, even on a coarse clock
    sys.modules.pop("template_edited")
    mod = __import__("template_edited")
    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(mod.W)) as wg:
        assert wg.version() == [2, 2]


def test_a_template_that_died_is_made_again_with_one_warning(caplog):
    with _group() as wg:
        template = wg.where()[0]["ppid"]
    os.kill(template, signal.SIGKILL)
    assert wait_gone([template], 10) == []
    with caplog.at_level(logging.WARNING, logger="spmdcall"):
        with _group() as wg:
            where = wg.where()
    assert {w["ppid"] for w in where} != {template}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"template (pid {template}) has ended" in warnings[0], warnings


def test_a_stuck_import_ends_the_start_within_start_timeout(tmp_path, monkeypatch):
    mod = _module(
        tmp_path,
        monkeypatch,
        "template_stuck",
        """
        import os, time
        if os.environ.get("SPMD_TEMPLATE_TEST") == "stuck":
            time.sleep(3600)
        class W:
            pass
        """,
    )
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not import .*template_stuck.* within 2 s"):
        sc.WorkerGroup(
            sc.ResourcePool([2]),
            sc.ClassWithInitArgs(mod.W),
            env={"SPMD_TEMPLATE_TEST": "stuck"},
            start_timeout=2,
        )
    assert time.monotonic() - start < 30


def test_no_template_or_rank_outlives_a_controller_killed_with_sigkill():
    proc = run_controller(
        """
        import os, time
        import spmdcall as sc
        from test_process_templates import Probe

        wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Probe))
        where = wg.where()
        print(where[0]["ppid"], *(w["pid"] for w in where), flush=True)
        time.sleep(600)
        """
    )
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 3 and all(alive(p) for p in pids)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert wait_gone(pids, 10) == [], "a template or rank outlived its controller"


def test_a_controller_that_exits_leaves_no_template_behind():
    script = """
    import spmdcall as sc
    from test_process_templates import Probe

    with sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(Probe)) as wg:
        print(wg.where()[0]["ppid"], flush=True)
    """
    proc = run_controller(script)
    template = int(proc.stdout.readline())
    assert proc.wait(60) == 0
    assert wait_gone([template], 10) == []
