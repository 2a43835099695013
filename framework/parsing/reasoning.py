"""The reasoning-parser plugin kind (``register_reasoning_parsers``): ``<think>``-style output.

A parser is declared by its markers: :class:`ReasoningParser` does the splitting, whole
(:meth:`ReasoningParser.split`) or streamed (:class:`ReasoningStream`), and both agree: the
concatenated stream deltas equal the whole split. Models differ in whether their chat template
already opened the reasoning (DeepSeek-R1: the output starts inside it, ``<think>`` optional) or
the model writes the start marker itself (Qwen3).
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.parsing.markers import partial_suffix


@dataclass(frozen=True)
class ReasoningParser:
    """Splits reasoning from content by ``start`` / ``end`` markers."""

    start: str = "<think>"
    end: str = "</think>"
    starts_in_reasoning: bool = False
    """True when the prompt already opened the reasoning: text before ``end`` is reasoning even
    without ``start``."""

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None when the output has none, content)."""
        stream = ReasoningStream(self)
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        reasoning = r1 + r2
        return (reasoning if stream.saw_reasoning else None), c1 + c2


class ReasoningStream:
    """Incremental :meth:`ReasoningParser.split`: ``feed`` returns (reasoning delta, content
    delta); partial markers are held back until they are decided."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.p = parser
        self.buf = ""
        self.state = "start"  # start: not yet known whether the output opens with the start marker
        self.saw_reasoning = False

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(self.p.start):
                    self.buf, self.state, self.saw_reasoning = stripped[len(self.p.start):], "reasoning", True
                    continue
                if self.p.start.startswith(stripped):
                    return reasoning, content  # empty or a partial start marker: undecided
                self.state = "reasoning" if self.p.starts_in_reasoning else "content"
                self.saw_reasoning = self.p.starts_in_reasoning
                continue
            if self.state == "reasoning":
                idx = self.buf.find(self.p.end)
                if idx >= 0:
                    reasoning += self.buf[:idx]
                    self.buf, self.state = self.buf[idx + len(self.p.end):], "content"
                    continue
                keep = partial_suffix(self.buf, self.p.end)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return reasoning, content
            content += self.buf
            self.buf = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, once the output is complete."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning" or (self.state == "start" and self.p.starts_in_reasoning):
            self.saw_reasoning = True
            return rest, ""
        return "", rest
