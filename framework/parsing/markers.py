"""Text-marker helpers shared by the streaming parsers."""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with: those characters
    must be held back while streaming, the marker may be arriving."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
