"""MkDocs hook (mkdocs.yml `hooks:`): `\\|` in a table's code span reads as `|`.

A pipe inside a Markdown table cell must be escaped (`auto\\|float32`) or it splits the
cell. GitHub drops the backslash inside code spans; Python-Markdown keeps it. This hook
drops it in the rendered pages, so the same source reads the same on both.
"""

from __future__ import annotations

import re

_CODE = re.compile(r"<code>(.*?)</code>", re.DOTALL)


def on_page_content(html: str, **kwargs) -> str:
    return _CODE.sub(lambda match: match.group(0).replace("\\|", "|"), html)
