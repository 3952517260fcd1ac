"""No module reads another module's private names (STYLE.md 21, DESIGN.md Layers).

A static check of every module of ``spmdcall`` and ``rl_extension``: an attribute ``obj._name``
(read or written) is a finding unless ``_name`` is defined in the same module — as a function,
class or variable, or as an attribute of ``self``/``cls`` that the module sets. So are
``from module import _name`` and a ``Protocol`` whose members are private (a Protocol is a
contract between modules: its members are public). Dunder names are fine; so are the private
names of other packages listed in :data:`ALLOWED`, each with why it is needed.

Run: ``python -m pytest tests/test_layers_private.py -q``
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("spmdcall", "rl_extension")

# ``base._name`` (``*`` for a base that is not a plain name: a call, a subscript) -> why it is read.
ALLOWED = {
    "os._exit": "a forked child must end without running the parent's atexit hooks and finalizers",
    "os._Environ": "the type of os.environ, to tell a copy of the environment from the live one",
    "sys._current_frames": "the only way to take the stack of every thread (rank reports)",
    "asyncio._get_running_loop": "the loop of this thread or None, without the exception of get_running_loop",
    "torch._foreach_copy_": "one fused copy of many tensors into the rollout's weights",
    "torch.cpu._is_amx_tile_supported": "whether the CPU has AMX tiles; torch has no public query for it",
    "*._as_handle": "Monarch's Future has no public way to observe a reply from many threads without consuming it",
    "fn._dynamo_marked_constant": "what torch._dynamo's assume_constant_result sets, done without importing dynamo",
    "counter._private": "the conformance suite checks that a group hides a worker's private methods",
}


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _is_private(name: str) -> bool:
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))


def _defined(tree: ast.AST) -> set[str]:
    """The names a module defines: functions, classes, variables, arguments, imports, and the
    attributes of ``self``/``cls`` it sets."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            names.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
    return names


def _base(node: ast.Attribute) -> str:
    parts = []
    value: ast.AST = node.value
    while isinstance(value, ast.Attribute):
        parts.append(value.attr)
        value = value.value
    if not isinstance(value, ast.Name):
        return "*"
    return ".".join([value.id, *reversed(parts)])


def findings(path: Path) -> list[str]:
    """Where the module at ``path`` reaches into another module's private names."""
    tree = ast.parse(path.read_text(), str(path))
    defined = _defined(tree)
    where = path.relative_to(ROOT)
    out: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in defined:
            key = f"{_base(node)}.{node.attr}"
            if key not in ALLOWED:
                out.append((node.lineno, node.col_offset, f"{where}:{node.lineno}: {ast.unparse(node)[:70]}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            for alias in node.names:
                if _is_private(alias.name) and f"{node.module}.{alias.name}" not in ALLOWED:
                    out.append(
                        (node.lineno, 0, f"{where}:{node.lineno}: from {node.module} import {alias.name}")
                    )
        elif isinstance(node, ast.ClassDef) and any(
            ast.unparse(b).split("[")[0].endswith("Protocol") for b in node.bases
        ):
            for member in node.body:
                name = None
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = member.name
                elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                    name = member.target.id
                if name is not None and _is_private(name):
                    out.append(
                        (member.lineno, 0, f"{where}:{member.lineno}: Protocol {node.name} declares {name}")
                    )
    return [text for _, _, text in sorted(out)]


def test_no_module_reads_another_modules_private_names():
    found = [f for path in _modules() for f in findings(path)]
    assert not found, "private names read across modules (give them a public name):\n" + "\n".join(found)


def test_the_check_finds_a_private_name_read_across_modules(tmp_path):
    mine = tmp_path / "mine.py"
    mine.write_text(
        "from typing import Protocol\n"
        "from other import _helper\n"
        "class P(Protocol):\n"
        "    _state: int\n"
        "class A:\n"
        "    def __init__(self):\n"
        "        self._own = 1\n"
        "    def f(self, group):\n"
        "        return self._own, self.__class__, group._backend, self._inherited\n"
    )
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        found = findings(mine)
    finally:
        ROOT = root
    assert [f.split(": ", 1)[1] for f in found] == [
        "from other import _helper",
        "Protocol P declares _state",
        "group._backend",
        "self._inherited",
    ]
