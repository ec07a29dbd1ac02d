"""Markers in streamed output text: what the reasoning and tool-call parsers hold back."""

from __future__ import annotations


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`: text that may
    still become `tag` once more output comes."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
