"""Run every script in examples/ as its own process, once per backend it supports.

An example passes when it exits with status 0 (each one asserts its own results) and leaves no
process behind. New files in examples/ are picked up automatically; list an example below only
when it needs an optional package or cannot run on some backend.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
BACKENDS = ["process", "inline", "ray"]

# Optional packages an example imports; the example is skipped where one is missing.
REQUIRES: dict[str, list[str]] = {
    "verl_style.py": ["torch", "tensordict", "ray"],
    "colocation.py": ["torch", "tensordict"],
    "data_parallel.py": ["torch", "tensordict"],
    "fsdp2_training.py": ["torch", "tensordict", "transformers"],
    "torch_distributed.py": ["torch"],
    "trace_calls.py": ["torch", "tensordict"],
}
# Backends an example refuses by design: it must exit with argparse's status 2 and say why.
REFUSES: dict[str, set[str]] = {
    # a verl driver calls ray.get on non-blocking results
    "verl_style.py": {"process", "inline"},
    # collectives need every rank running at once
    "fsdp2_training.py": {"inline"},
    "torch_distributed.py": {"inline"},
}

# The extra of spmdcall that installs each optional package (an example's docstring names it).
EXTRA_OF = {"torch": "torch", "tensordict": "torch", "transformers": "rl", "ray": "ray"}

RUN_TIMEOUT_S = 100
# Examples that start many Ray actors, each importing torch, take longer on a small machine.
SLOW_RUN_TIMEOUT_S = {"verl_style.py": 240}
# How long processes an example started may take to go away after it exits (Ray's daemons are slow).
GRACE_S = {"process": 5.0, "inline": 5.0, "ray": 20.0, "monarch": 10.0}
TOKEN_VAR = "SPMDCALL_EXAMPLE_TEST_TOKEN"


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# Ray's distribution, not _have("ray"): pytest puts tests/ on sys.path, where tests/ray/ passes for a
# namespace package named ray when Ray is not installed.
HAVE_RAY = (
    _have("spmdcall.backends.ray.backend")
    and next(iter(metadata.distributions(name="ray")), None) is not None
)


# Each run on ray starts a Ray cluster of its own (12-27 s on 2 cores). The suite runs on ray the
# examples whose ray path nothing else runs end to end; what the others show is tested on ray by the
# conformance suite (spmdcall/testing, run by tests/conformance: any class, data parallel, custom modes,
# tracing) and test_fsdp2. EXAMPLES_ON_EVERY_BACKEND=1 runs every example on every backend.
ON_RAY = {"async_driver.py", "colocation.py", "torch_distributed.py", "verl_style.py"}
# The examples take --backend monarch too (docs/backends/monarch.md lists which run there); one
# of them runs on it here, where torchmonarch is installed: a group's start there takes seconds,
# and what the others show the conformance suite checks on monarch (tests/conformance).
ON_MONARCH = {"any_class.py"}
HAVE_MONARCH = _have("monarch")


def _params():
    every_backend = os.environ.get("EXAMPLES_ON_EVERY_BACKEND") == "1"
    for example in EXAMPLES:
        for backend in BACKENDS:
            if backend == "ray" and not every_backend and example not in ON_RAY:
                continue
            marks = [pytest.mark.ray] if backend == "ray" else []
            yield pytest.param(example, backend, id=f"{example[:-3]}-{backend}", marks=marks)
        # A ray-only driver (it refuses process) refuses monarch the same way.
        if (example in ON_MONARCH or every_backend) and "process" not in REFUSES.get(example, set()):
            yield pytest.param(example, "monarch", id=f"{example[:-3]}-monarch")


def _processes_with_token(psutil, token: str) -> list:
    """Every process whose environment carries ``token``: the example's workers inherit it."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(TOKEN_VAR) == token:
                found.append(proc)
        except (psutil.Error, OSError):
            pass  # gone, a zombie, or not ours to read
    return found


def _describe(procs: list) -> list[str]:
    out = []
    for proc in procs:
        try:
            out.append(f"pid {proc.pid}: {' '.join(proc.cmdline())[:200]}")
        except Exception:
            out.append(f"pid {proc.pid}")
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example, backend", list(_params()))
def test_example(example: str, backend: str, tmp_path: Path) -> None:
    missing = [m for m in REQUIRES.get(example, []) if not _have(m)]
    if missing:
        pytest.skip(f"{example} needs {', '.join(missing)}")
    if backend == "ray" and not HAVE_RAY:
        pytest.skip("the ray backend needs Ray installed")
    if backend == "monarch" and not HAVE_MONARCH:
        pytest.skip("the monarch backend needs torchmonarch installed")

    token = uuid.uuid4().hex
    env = {**os.environ, TOKEN_VAR: token, "PYTHONBREAKPOINT": "0", "PYTHONUNBUFFERED": "1"}
    if backend != "ray":  # Ray keeps its sockets under TMPDIR, where a long pytest path is too long
        env["TMPDIR"] = str(tmp_path)
    cmd = [sys.executable, str(ROOT / "examples" / example), "--backend", backend]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    limit = SLOW_RUN_TIMEOUT_S.get(example, RUN_TIMEOUT_S)
    try:
        stdout, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()  # its workers notice their controller is gone and exit on their own
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"{example} --backend {backend} ran longer than {limit} s\n"
            f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
        )
    output = f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"

    if backend in REFUSES.get(example, set()):
        assert proc.returncode == 2, f"{example} should refuse --backend {backend}\n{output}"
        assert backend in stderr, f"{example} should say why it refuses --backend {backend}\n{output}"
    else:
        assert proc.returncode == 0, f"{example} --backend {backend} exited with {proc.returncode}\n{output}"

    psutil = pytest.importorskip("psutil", reason="psutil is needed to look for leftover processes")
    deadline = time.monotonic() + GRACE_S[backend]
    while (leftovers := _processes_with_token(psutil, token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftovers, f"{example} --backend {backend} left processes running:\n" + "\n".join(
        _describe(leftovers)
    )


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_docstring_says_what_it_needs(example: str) -> None:
    """The docstring names the extra for what the example imports and the backends it takes."""
    tree = ast.parse((ROOT / "examples" / example).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    optional = {name.partition(".")[0] for name in imported} - set(sys.stdlib_module_names)
    optional -= {"spmdcall", "numpy", "cloudpickle"}  # spmdcall's own dependencies
    assert optional <= set(REQUIRES.get(example, [])), f"list {sorted(optional)} under REQUIRES[{example!r}]"
    doc = ast.get_docstring(tree) or ""
    extras = {EXTRA_OF[module] for module in REQUIRES.get(example, [])}
    if "rl" in extras:
        extras.discard("torch")  # [rl] includes [torch]
    named = {e for group in re.findall(r'pip install "spmdcall\[([a-z,]+)\]"', doc) for e in group.split(",")}
    assert extras <= named, (
        f'{example}\'s docstring should name pip install "spmdcall[{",".join(sorted(extras))}]"'
    )
    usage = re.search(rf"python examples/{re.escape(example)} .*\[--backend ([a-z|]+)\]", doc)
    assert usage, f"{example}'s docstring should show how to run it, with [--backend ...]"
    assert set(usage.group(1).split("|")) == set(BACKENDS) - REFUSES.get(example, set())


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_docs_name_the_examples_that_refuse_a_backend(page: str) -> None:
    """Where a page says which backends the examples take, it names the exceptions."""
    paragraphs = (ROOT / page).read_text().split("\n\n")
    about_examples = [p for p in paragraphs if "examples/" in p and "--backend" in p]
    assert about_examples, f"{page} should say which --backend the examples take"
    for paragraph in about_examples:
        assert "process|inline|ray" not in paragraph, paragraph
        for example, refused in REFUSES.items():
            assert example in paragraph and all(backend in paragraph for backend in refused), paragraph
