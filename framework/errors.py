"""Errors the user sees: each names what is wrong and what would be accepted."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class PlugserveError(Exception):
    """Base class of plugserve's own errors."""


class ConfigError(PlugserveError):
    """The configuration is invalid: the message names the key path and the allowed values."""


class PluginError(PlugserveError):
    """A plugin failed to load or conflicts with another plugin."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return ' Did you mean "x"?' for the closest choice, or '' when none is close."""
    choices = list(choices)
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close and len(word) >= 3:
        # A truncated name ("max_queue" for "max_queue_for_matching") is far by edit distance.
        close = [c for c in choices if c.startswith(word)][:1]
    return f' Did you mean "{close[0]}"?' if close else ""
