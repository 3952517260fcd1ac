"""Optional modules loaded on first use must be safe when several threads use them first at once."""

from __future__ import annotations

import importlib
import sys
import threading

import pytest
from procs import run_controller

from spmdcall.lazy import loaded

pytestmark = pytest.mark.timeout(180)


def test_a_module_being_imported_by_another_thread_is_not_loaded_yet(tmp_path, monkeypatch):
    (tmp_path / "slow_module_for_lazy_test.py").write_text(
        "import threading\nstarted = threading.Event()\nproceed = threading.Event()\n"
        "import builtins\nbuiltins._lazy_test_hooks = (started, proceed)\n"
        "started.set()\nproceed.wait(30)\nVALUE = 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import builtins

    importer = threading.Thread(target=importlib.import_module, args=("slow_module_for_lazy_test",))
    importer.start()
    try:
        for _ in range(300):
            if hasattr(builtins, "_lazy_test_hooks"):
                break
            threading.Event().wait(0.01)
        started, proceed = builtins._lazy_test_hooks
        started.wait(10)
        assert "slow_module_for_lazy_test" in sys.modules  # half-built, and there
        assert loaded("slow_module_for_lazy_test") is None
        proceed.set()
        importer.join(10)
        assert loaded("slow_module_for_lazy_test").VALUE == 1
    finally:
        del builtins._lazy_test_hooks
        sys.modules.pop("slow_module_for_lazy_test", None)


@pytest.mark.parametrize("backend", ["inline", "process"])
def test_threads_that_first_use_data_proto_at_once(backend):
    """A fresh controller whose threads all start at once: half of them make the first DataProto
    calls (loading torch and spmdcall.data) while the others make plain calls."""
    proc = run_controller(
        f"""
        import threading, sys
        import spmdcall as sc

        class W(sc.Worker):
            def add(self, a):
                return a + self.rank

            @sc.register(dispatch_mode=sc.Dispatch.DP_COMPUTE_PROTO)
            def double(self, batch):
                return batch.__class__.from_dict({{"x": batch.batch["x"] * 2}})

        assert "spmdcall.data" not in sys.modules and "torch" not in sys.modules
        wg = sc.WorkerGroup(sc.ResourcePool([2]), sc.ClassWithInitArgs(W), backend="{backend}")
        start, failures = threading.Barrier(8), []

        def body(t):
            start.wait()
            try:
                for i in range(10):
                    if t % 2:
                        from spmdcall import DataProto
                        import torch
                        out = wg.double(DataProto.from_dict({{"x": torch.full((4,), float(i))}}))
                        assert out.batch["x"].tolist() == [2.0 * i] * 4, out
                    else:
                        assert wg.add(i) == [i, i + 1]
            except BaseException as exc:
                failures.append(repr(exc))

        threads = [threading.Thread(target=body, args=(t,)) for t in range(8)]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        wg.shutdown()
        print("FAILURES", failures, "STUCK", sum(t.is_alive() for t in threads))
        """
    )
    out, _ = proc.communicate(timeout=170)
    assert "FAILURES [] STUCK 0" in out, out
