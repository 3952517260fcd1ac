"""Run verl's own single-controller and DataProto tests against spmdcall.compat.verl.

    make verl-compat VERL_SRC=path/to/verl                  # both backends, every file
    python tools/verl_compat.py path/to/verl --backend ray --file colocated -k fused --keep

In a temporary folder it writes the re-export ``verl`` package (``spmdcall.compat.verl.shim``),
copies ``verl/utils`` from the checkout (with an empty ``__init__.py``: verl's own pulls in
omegaconf and transformers, which the tests do not use) and copies the tests
(``tests/test_protocol_on_cpu.py``, ``tests/single_controller/``). Then it runs each test file in
its own pytest process, once per backend (``RayWorkerGroup``'s default is set in a generated
conftest.py), and prints passed/failed per file and every failing test.

The tests start and stop Ray themselves; ``RAY_OVERRIDE_RESOURCES`` gives every such Ray 16 CPUs
and 8 logical GPUs, so tests that only name GPUs as Ray bookkeeping (``use_gpu=True``) place on a
CPU machine. Files that need CUDA or NCCL are listed in ``NEEDS_GPU`` with the reason and not run.
Exit status: 0 when the pass rate of every backend reaches ``--min-pass-rate`` (default 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_PATHS = ["tests/test_protocol_on_cpu.py", "tests/single_controller"]
NEEDS_GPU = {
    "tests/single_controller/test_ray_collectives.py": "NCCL collectives between CUDA tensors",
    "tests/single_controller/test_rvdz.py": "an NCCL communicator",
    "tests/single_controller/test_device_mesh_register.py": "init_process_group(backend='nccl')",
    "tests/single_controller/test_split_resource_pool.py": "init_process_group(backend='nccl')",
    "tests/single_controller/test_data_transfer.py": "8 GPUs moving 2 GiB (and codetiming)",
}
NOT_TESTS = {"tests/single_controller/check_worker_alive/main.py", "tests/single_controller/detached_worker/client.py",
             "tests/single_controller/detached_worker/server.py"}  # fmt: skip
CONFTEST = '''"""Written by tools/verl_compat.py: the backend verl's RayWorkerGroups run on."""
import os

from spmdcall.compat.verl import set_default_backend

set_default_backend(os.environ["SPMDCALL_VERL_BACKEND"])
'''
RAY_RESOURCES = {"CPU": 16, "GPU": 8, "object_store_memory": 1 << 30}


def build(verl_src: Path, where: Path) -> list[str]:
    """Write the shim, copy verl's utils and tests into ``where``; the test files to run."""
    sys.path.insert(0, str(ROOT))
    from spmdcall.compat.verl.shim import write_shim

    package = write_shim(where)
    shutil.copytree(verl_src / "verl" / "utils", package / "utils")
    (package / "utils" / "__init__.py").write_text("")
    for path in ["tests/__init__.py", *TEST_PATHS]:
        source, target = verl_src / path, where / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target)
        elif source.exists():
            shutil.copy(source, target)
    (where / "conftest.py").write_text(CONFTEST)
    files = sorted(p.relative_to(where).as_posix() for path in TEST_PATHS for p in _test_files(where / path))
    return [f for f in files if f not in NOT_TESTS]


def _test_files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(path.rglob("test_*.py"))


def run_file(where: Path, test_file: str, backend: str, args: argparse.Namespace) -> dict:
    """Run one file on one backend; ``{"passed": [...], "failed": [...], "skipped": [...]}``."""
    report = where / f"report-{backend}-{test_file.replace('/', '_')}.xml"
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray", dir=where))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(where), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        SPMDCALL_VERL_BACKEND=backend,
        RAY_TMPDIR=str(ray_tmp),
        RAY_OVERRIDE_RESOURCES=json.dumps(RAY_RESOURCES),
    )
    command = [
        sys.executable,
        "-m",
        "pytest",
        test_file,
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
    ]
    command += [f"--timeout={args.timeout}", "-o", "addopts="] + (["-k", args.k] if args.k else [])
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=where, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=args.timeout * 4)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    _stop_leftovers(ray_tmp)
    results: dict = {"passed": [], "failed": [], "skipped": [], "seconds": time.monotonic() - started}
    if not report.exists():
        results["failed"].append(f"{test_file} (no report: pytest did not finish)")
    else:
        for case in ET.parse(report).getroot().iter("testcase"):
            name = f"{test_file}::{case.get('name')}"
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            results["skipped" if kind == "skipped" else "failed" if kind != "passed" else "passed"].append(
                name
            )
    if args.verbose or (results["failed"] and args.show_output):
        print(output)
    return results


def _stop_leftovers(ray_tmp: Path) -> None:
    """Stop processes a test's Ray left running (they name its temp dir on their command line)."""
    try:
        import psutil
    except ImportError:
        return
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if str(ray_tmp) in " ".join(proc.info["cmdline"] or []):
                proc.kill()
        except psutil.Error:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("verl_src", type=Path, help="a checkout of https://github.com/volcengine/verl")
    parser.add_argument("--backend", action="append", choices=["ray", "process", "inline"],
                        help="backend(s) to run on (default: ray and process)")  # fmt: skip
    parser.add_argument("-k", help="pytest -k expression, to run some tests only")
    parser.add_argument("--file", action="append", help="run only the test files whose path contains this")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    parser.add_argument("--min-pass-rate", type=float, default=0.9)
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (printed)")
    parser.add_argument("--show-output", action="store_true", help="print pytest's output of failing files")
    parser.add_argument("--verbose", action="store_true", help="print pytest's output of every file")
    args = parser.parse_args(argv)
    if not (args.verl_src / "verl" / "single_controller").is_dir():
        parser.error(f"{args.verl_src} is not a verl checkout (no verl/single_controller)")
    backends = args.backend or ["ray", "process"]
    where = Path(tempfile.mkdtemp(prefix="verl-compat-"))
    try:
        files = build(args.verl_src.resolve(), where)
        commit = subprocess.run(["git", "-C", str(args.verl_src), "log", "-1", "--format=%h %cs"],
                                capture_output=True, text=True).stdout.strip() or "unknown commit"  # fmt: skip
        print(f"verl {commit} from {args.verl_src}; spmdcall from {ROOT}; work dir {where}")
        for path, reason in NEEDS_GPU.items():
            print(f"  not run: {path}: needs {reason}")
        ok = True
        for backend in backends:
            total: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
            print(f"\n== backend {backend}")
            for test_file in files:
                if test_file in NEEDS_GPU or (args.file and not any(part in test_file for part in args.file)):
                    continue
                res = run_file(where, test_file, backend, args)
                for key in total:
                    total[key] += res[key]
                print(f"  {test_file:<62} passed {len(res['passed']):>3}  failed {len(res['failed']):>3}"
                      f"  skipped {len(res['skipped']):>2}  ({res['seconds']:.0f} s)", flush=True)  # fmt: skip
            ran = len(total["passed"]) + len(total["failed"])
            rate = len(total["passed"]) / ran if ran else 0.0
            print(
                f"  {backend}: {len(total['passed'])} of {ran} passed ({rate:.1%}), {len(total['skipped'])} skipped"
            )
            for name in total["failed"]:
                print(f"    FAILED {name}")
            ok = ok and rate >= args.min_pass_rate
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"kept {where}")
        else:
            shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
