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
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f' Did you mean "{close[0]}"?' if close else ""
