"""A griffe extension for the API reference: read spmdcall's docstrings the way they are written.

spmdcall's docstrings (STYLE.md) say ``Example:`` where the Google style griffe parses says
``Examples:``; without this, such a section renders as plain Markdown, where ``>>>`` prompts become
block quotes and ``[4, 4]`` a link. They also use Sphinx roles (:func:`colocate`), which Markdown
would print as written; they become code spans. Loaded by mkdocs.yml.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_SPHINX_ROLE = re.compile(r":(?:func|class|meth|mod|attr|exc|data|obj):`~?([^`]+)`")


class SpmdcallDocstrings(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = _EXAMPLE_HEADING.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _SPHINX_ROLE.sub(r"`\1`", text)
