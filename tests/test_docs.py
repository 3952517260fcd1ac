"""Every ```python block in docs/**/*.md and README.md runs as written (the Quickstarts print what
their comments say), and the API reference is complete.

Each block runs as a standalone script in a fresh interpreter (cwd: a temporary folder,
PYTHONPATH: the repository root). A block that needs hardware the test machine may not have (a
GPU, a multi-node cluster) opts out with an HTML comment on the line before its fence:

    <!-- no-test -->
    ```python
    ...
    ```
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
from procs import with_sigint

ROOT = pathlib.Path(__file__).resolve().parent.parent
NO_TEST = "<!-- no-test -->"
BLOCK_TIMEOUT_S = 120
# Blocks whose ``print(...)  # output`` lines must print what their comments say: the Quickstarts.
PRINTS_CHECKED = {("README.md", 0), ("docs/index.md", 0), ("docs/rl/agents.md", 0)}
# An opening fence (possibly indented, e.g. inside a list item), its body, the matching close.
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.MULTILINE | re.DOTALL
)


def check_printed(code: str, stdout: str, where: str) -> None:
    """Each ``print(...)  # comment`` line of ``code`` printed what its comment says (the comment
    may go on after a colon: ``# [4, 4]: one result per rank``), and nothing else was printed."""
    said = [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s*#\s*(.+)$", code, re.M)]
    printed = stdout.strip().splitlines()
    assert said and len(printed) == len(said), f"{where} printed {printed}, its comments say {said}"
    for line, comment in zip(printed, said):
        assert comment == line or comment.startswith(f"{line}:"), (
            f"{where} printed {line!r}, its comment says {comment!r}"
        )


def doc_files() -> list[pathlib.Path]:
    return sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """``(line number, code, opted out)`` of every python block of a Markdown text."""
    blocks = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip().splitlines()
        opted_out = bool(before) and before[-1].strip() == NO_TEST
        indent = match.group("indent")
        code = "".join(
            line[len(indent) :] if line.startswith(indent) else line
            for line in match.group("body").splitlines(keepends=True)
        )
        blocks.append((text.count("\n", 0, match.start()) + 1, code, opted_out))
    return blocks


def _cases() -> list:
    cases = []
    for path in doc_files():
        name = path.relative_to(ROOT).as_posix()
        for index, (line, code, opted_out) in enumerate(python_blocks(path.read_text())):
            marks = [pytest.mark.skip(reason=f"{NO_TEST} in {name} (line {line})")] if opted_out else []
            checked = (name, index) in PRINTS_CHECKED
            cases.append(pytest.param(name, line, code, checked, id=f"{name}:{index}", marks=marks))
    return cases


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)
@pytest.mark.parametrize(("doc", "line", "code", "prints_checked"), _cases())
def test_doc_block_runs(doc, line, code, prints_checked, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        PYTHONBREAKPOINT="0",
    )
    try:
        out = subprocess.run(
            with_sigint(str(script)),  # as from a terminal (a block shows what Ctrl-C does)
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"the block at {doc}:{line} ran longer than {BLOCK_TIMEOUT_S} s\n{exc.stdout or ''}{exc.stderr or ''}"
        )
    assert out.returncode == 0, f"the block at {doc}:{line} failed:\n{out.stdout}\n{out.stderr}"
    if prints_checked:
        check_printed(code, out.stdout, f"the block at {doc}:{line}")


def test_block_parser():
    text = "a\n```python\nx = 1\n```\n\n<!-- no-test -->\n\n```python\ngpu()\n```\n- item\n\n  ```python\n  y = 2\n  ```\n"
    assert python_blocks(text) == [(2, "x = 1\n", False), (8, "gpu()\n", True), (13, "y = 2\n", False)]


def test_check_printed():
    code = "print(a)  # [4, 4]: one per rank\nprint(b)  # [0, 2, 4]\n"
    check_printed(code, "[4, 4]\n[0, 2, 4]\n", "ok")
    for wrong in (
        "[4, 4]\n[0.0, 2.0, 4.0]\n",
        "[4, 4]\n",
        "[4, 4]\n[0, 2, 4]\nmore\n",
        "[4, 4]:\n[0, 2, 4]\n",
    ):
        with pytest.raises(AssertionError):
            check_printed(code, wrong, "wrong")


def test_api_reference_covers_the_public_api():
    import spmdcall

    documented = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: spmdcall\.(\w+)\s*$", page.read_text(), re.MULTILINE))
    missing = sorted(set(spmdcall.__all__) - documented)
    assert not missing, (
        f"names in spmdcall.__all__ without a '::: spmdcall.NAME' entry under docs/api/: {missing}"
    )


def test_nav_lists_every_page():
    """mkdocs only mentions pages left out of the nav; here that is an error."""
    nav = set(re.findall(r":\s*([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert not sorted(pages - nav), f"pages missing from the nav in mkdocs.yml: {sorted(pages - nav)}"


def _mkdocs_setting(key: str) -> str:
    return re.search(rf"^{key}: (\S+)$", (ROOT / "mkdocs.yml").read_text(), re.M).group(1)


def test_project_urls_match_the_docs_site():
    urls = dict(re.findall(r'^(\w+) = "(https://[^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M))
    assert urls["Documentation"] == _mkdocs_setting("site_url")
    assert urls["Source"] == _mkdocs_setting("repo_url")
    assert urls["Issues"] == f"{urls['Source']}/issues"


def test_readme_links_work_on_the_package_page():
    """The README is also the package page, away from the repository: its links are absolute, and
    those into this project name a page of the docs site or a file of the repository that exists."""
    site, repo = _mkdocs_setting("site_url"), _mkdocs_setting("repo_url")
    links = re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    assert links, "no links in the README"
    relative = [link for link in links if not link.startswith("https://")]
    assert not relative, f"README links that are dead on the package page: {relative}"
    for link in links:
        if link.startswith(site):
            page = link[len(site) :].partition("#")[0].strip("/")
            candidates = [ROOT / "docs" / f"{page}.md", ROOT / "docs" / page / "index.md"]
            assert any(c.is_file() for c in candidates), f"{link}: no such page under docs/"
        elif link.startswith(f"{repo}/"):
            path = re.sub(r"^(blob|tree)/main/?", "", link[len(repo) + 1 :])
            assert path == "issues" or (ROOT / path).exists(), f"{link}: no such file in the repository"


def test_index_links_every_backend_page():
    index = (ROOT / "docs" / "index.md").read_text()
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs" / "backends").glob("*.md"))
    assert pages, "no pages under docs/backends/"
    missing = [page for page in pages if f"]({page})" not in index]
    assert not missing, f"docs/index.md should link every backend page: {missing}"


@pytest.mark.timeout(300)
def test_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: broken links, missing pages and docstring warnings fail."""
    pytest.importorskip("mkdocs", reason="the docs tools are not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # mkdocstrings formats signatures with ruff (in the docs extra); without it, it says so.
    assert "Formatting signatures requires" not in out.stdout + out.stderr
