"""Incremental detokenization and stop strings.

Decoding token by token is not ``"".join(decode([t]) for t in ids)``: a byte-level BPE token can
be part of a UTF-8 character, and SentencePiece decoders drop the leading space of the *first*
token of whatever they decode. :class:`IncrementalDetokenizer` therefore decodes a short sliding
window of tokens twice (with and without the newest ones) and emits the difference, holding it back
while it ends in an incomplete character (``"\\ufffd"``). The window starts a few tokens into the
prompt so the first output token is decoded in context.

:class:`StopStringMatcher` sits after it and never lets a stop string straddle two emitted chunks:
it holds back any tail that could still become a stop string.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"
"""What tokenizers decode an incomplete or invalid UTF-8 sequence to."""

PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens kept as decoding context. SentencePiece needs one to keep the first output
token's leading space; a few more cover a multi-byte character split across prompt tokens."""


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of finished text.

    ``"".join(add(...) for each chunk) + flush()`` equals ``tokenizer.decode(output_ids)`` for
    byte-level BPE tokenizers (and ``decode(prompt + output)`` minus the prompt's text when a
    prompt is given). Tokenizer clean-up of spaces is always off: it is not local to a window, so
    no streaming decoder can reproduce it; vLLM and SGLang leave it off for streams too.
    ``spaces_between_special_tokens`` is passed through; HF fast tokenizers ignore it.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self._decode_kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
            "clean_up_tokenization_spaces": False,
        }
        # Only the window [prefix_offset:] is ever decoded, so older ids are dropped as we go.
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix_offset = 0
        """Start of the decoding window: text before it is already emitted and no longer needed."""
        self._read_offset = len(self._ids)
        """End of what has been emitted (or belongs to the prompt)."""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self._decode_kwargs) if ids else ""

    def add(self, token_ids: list[int]) -> str:
        """Feed new token ids; return the text they complete (possibly ``""``)."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """End of stream: return whatever was held back, incomplete characters included."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or (not final and full_text.endswith(REPLACEMENT_CHAR)):
            # Nothing new yet (e.g. a skipped special token) or a character is still incomplete.
            return ""
        # The window always starts on an emitted boundary, so prefix_text is a prefix of
        # full_text (UTF-8 decoding resynchronises at character boundaries).
        delta = full_text[len(prefix_text) :]
        # The tokens just emitted become the next window's context; older ones are not needed.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return delta


class StopStringMatcher:
    """Streams text while watching for stop strings; the output ends right before the first one.

    "First" is the stop string whose occurrence *ends* first (it is the one generation would have
    stopped at, whatever the chunking), earliest start on a tie. Stop strings are not included in
    the output, as in the OpenAI API.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._held = ""
        self.stopped = False
        self.matched_stop: str | None = None
        """The stop string that ended the text, once :attr:`stopped`."""

    def feed(self, delta: str) -> str:
        """Return the part of the text so far that is safe to emit now."""
        if self.stopped:
            return ""
        buf = self._held + delta
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            start = buf.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                best = key if best is None or key < best else best
        if best is not None:
            _, start, stop = best
            self.stopped, self.matched_stop, self._held = True, stop, ""
            return buf[:start]
        keep = self._partial_stop_suffix_len(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """End of stream without a stop string: release the held-back tail."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

    def _partial_stop_suffix_len(self, text: str) -> int:
        # Longest suffix of text that is a proper prefix of some stop string.
        longest = min(len(text), max((len(s) - 1 for s in self.stops), default=0))
        for k in range(longest, 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


def find_stop_string_in_tail(
    tokenizer: Any,
    output_ids: list[int],
    stops: list[str],
    max_stop_len: int,
    *,
    skip_special_tokens: bool = True,
) -> bool:
    """Whether the text of the last few output tokens contains a stop string.

    For the scheduler, called after each new token: it decodes only ``4 * max_stop_len + 2``
    tokens (``max_stop_len`` in characters; a character is at most 4 UTF-8 bytes and a byte-level
    token at least one byte, plus a token of context for decoders that strip a leading space), so
    the cost does not grow with the output. A stop string straddling a skipped special token can
    be missed here; the detokenizer's :class:`StopStringMatcher` still truncates the text.
    """
    if not stops or not output_ids:
        return False
    window = output_ids[-(4 * max_stop_len + 2) :]
    text = tokenizer.decode(window, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    return any(stop in text for stop in stops if stop)
