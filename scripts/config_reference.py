"""Generate the reference tables of docs/rl/config.md from the config dataclasses.

    python scripts/config_reference.py                             print the tables
    python scripts/config_reference.py --write docs/rl/config.md   refresh them below that file's marker

Every key of ``PPOConfig`` and ``SFTConfig`` gets a row: its type (with its declared range), its
default and the docstring under the field. tests/rl/test_config.py checks that the page is current.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere: the rl_extension of this checkout

from rl_extension.config import PPOConfig, SFTConfig, field_docs  # noqa: E402
from rl_extension.config.ranges import describe_ranges  # noqa: E402
from rl_extension.config.schema import field_types  # noqa: E402

MARKER = "<!-- generated below by: python scripts/config_reference.py --write docs/rl/config.md -->"


def markdown_reference(classes: tuple[type, ...] = (PPOConfig, SFTConfig)) -> str:
    """A Markdown table per section: every key, its type and range, default and documentation."""
    lines = []
    for root in classes:
        lines += [f"## `{root.__name__}`", "", _summary(root), ""]
        for section_cls, prefix in _sections(root):
            title = f"### `{prefix.rstrip('.')}`" if prefix else f"### top level of `{root.__name__}`"
            lines += [title, "", _summary(section_cls), "", "| key | type | default | meaning |"]
            lines.append("| --- | --- | --- | --- |")
            lines += _rows(section_cls, prefix)
            lines.append("")
    return "\n".join(lines)


def _rows(section_cls: type, prefix: str) -> list[str]:
    docs, ranges, default = field_docs(section_cls), describe_ranges(section_cls), section_cls()
    rows = []
    for name, tp in field_types(section_cls).items():
        if dataclasses.is_dataclass(tp):
            continue
        shown = yaml.safe_dump(getattr(default, name), default_flow_style=True, width=1000).strip()
        shown = shown.removesuffix("\n...").removesuffix("...").strip()
        kind = _type_name(tp) + (f", {ranges[name]}" if name in ranges else "")
        rows.append(f"| `{prefix}{name}` | {kind} | `{shown}` | {docs.get(name, '')} |")
    return rows


def _summary(cls: type) -> str:
    return (inspect.getdoc(cls) or "").splitlines()[0]


def _sections(cls: type, prefix: str = "") -> list[tuple[type, str]]:
    """Every section under ``cls`` (itself first) with its dotted prefix, if it has keys of its own."""
    out = [(cls, prefix)]
    for name, tp in field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            out += _sections(tp, f"{prefix}{name}.")
    return [s for s in out if any(not dataclasses.is_dataclass(t) for t in field_types(s[0]).values())]


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]" if args else "list"
    return getattr(tp, "__name__", str(tp))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="PAGE", help="replace everything below the marker of this page")
    args = parser.parse_args(argv)
    if args.write is None:
        print(markdown_reference())
        return 0
    page = Path(args.write)
    head = page.read_text().split(MARKER)[0] if page.exists() else ""
    page.write_text(f"{head}{MARKER}\n\n{markdown_reference()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
