"""Built-in reasoning parsers: ``<think>`` ... ``</think>`` as DeepSeek-R1 and Qwen3 write it."""

from __future__ import annotations

from typing import Any

from framework.hookspecs import hookimpl
from framework.parsing.reasoning import ReasoningParser


def deepseek_r1(options: Any = None) -> ReasoningParser:
    """DeepSeek-R1: its chat template opens ``<think>``, so the output starts inside the
    reasoning (a ``<think>`` the model writes anyway is dropped); an output cut off before
    ``</think>`` is all reasoning."""
    return ReasoningParser("<think>", "</think>", starts_in_reasoning=True)


def qwen3(options: Any = None) -> ReasoningParser:
    """Qwen3: the model writes ``<think>`` itself when thinking is on; without it (thinking off)
    the output is all content."""
    return ReasoningParser("<think>", "</think>", starts_in_reasoning=False)


@hookimpl
def register_reasoning_parsers(register: Any) -> None:
    register("deepseek_r1", deepseek_r1)
    register("qwen3", qwen3)
