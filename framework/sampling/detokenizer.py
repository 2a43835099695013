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

from collections.abc import Callable
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
"""What tokenizers decode an incomplete or invalid UTF-8 sequence to."""

PROMPT_CONTEXT_TOKENS = 5
"""Tokens kept as decoding context: of the prompt at the start, of the emitted text after.
SentencePiece needs one to keep the next token's leading space; a few more cover a multi-byte
character split across prompt tokens."""

MAX_HELD_TOKENS = 32
"""Tokens held back (decoded but not yet emitted) before the detokenizer stops waiting for the
text to become printable and emits the part that can no longer change. Without a bound, a long
run of invalid UTF-8 is re-decoded whole at every step (quadratic in the run)."""

MIN_KEPT_TOKENS = 3
"""Newest tokens a bounded release keeps held: an unfinished UTF-8 character has at most 3 of
its bytes so far, and every visible token carries at least one byte."""

RELEASE_SPLIT_TRIES = 8
"""Split points a bounded release tries (keeping 3, 4, ... tokens) before it emits everything."""


def backend_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """The Rust backend's ``decode`` of a Hugging Face fast tokenizer, when it returns exactly what
    ``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`` does;
    None for any other tokenizer (a slow one, or a class that overrides how it decodes).

    Why: the detokenizer decodes two short windows per token, and the Python wrapper around the
    backend (argument conversion, keyword handling) costs several times the decode itself; in a
    server that is CPU taken from the model's threads on every token of every stream.
    """
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (not isinstance(tokenizer, PreTrainedTokenizerFast) or backend is None
            or cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not PreTrainedTokenizerFast._decode):
        return None
    decode = backend.decode
    return lambda ids: decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of finished text.

    ``"".join(add(...) for each chunk) + flush()`` equals ``tokenizer.decode(output_ids)`` for
    byte-level BPE tokenizers (and ``decode(prompt + output)`` minus the prompt's text when a
    prompt is given). Tokenizer clean-up of spaces is always off: it is not local to a window, so
    no streaming decoder can reproduce it; vLLM and SGLang leave it off for streams too.
    ``spaces_between_special_tokens`` is passed through; HF fast tokenizers ignore it.

    The decoded window stays bounded however long the text stays unprintable (vLLM's and SGLang's
    detokenizers re-decode an ever-growing window there): tokens that decode to nothing (skipped
    special tokens, ids outside the tokenizer) are dropped as they arrive, and once more than
    :data:`MAX_HELD_TOKENS` are held behind an unfinished character, the text before the last
    few tokens is emitted if splitting there provably decodes the same.
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
        self._decode_ids = backend_decoder(tokenizer, skip_special_tokens) or self._decode_hf
        # The window: already-emitted context tokens [0:_read_offset], then held-back ones.
        # Older ids are dropped as we go, so only this window is ever decoded.
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._read_offset = len(self._ids)
        """End of what has been emitted (or belongs to the prompt)."""
        self._context_text: str | None = None
        """Decoded text of the context tokens (``None``: not decoded since they changed)."""
        self._blank: dict[int, bool] = {}
        """Per token id: whether it decodes to nothing on its own (cached, as ids repeat)."""

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids) if ids else ""

    def _decode_hf(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self._decode_kwargs)

    def add(self, token_ids: list[int]) -> str:
        """Feed new token ids; return the text they complete (possibly ``""``)."""
        first_new = len(self._ids)
        self._ids.extend(token_ids)
        return self._emit(final=False, first_new=first_new)

    def flush(self) -> str:
        """End of stream: return whatever was held back, incomplete characters included."""
        return self._emit(final=True, first_new=len(self._ids))

    def _emit(self, final: bool, first_new: int) -> str:
        if self._context_text is None:
            self._context_text = self._decode(self._ids[: self._read_offset])
        prefix_text = self._context_text
        full_text = self._decode(self._ids)
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith(REPLACEMENT_CHAR)):
            # The window always starts on an emitted boundary, so prefix_text is a prefix of
            # full_text (UTF-8 decoding resynchronises at character boundaries).
            return self._advance(len(self._ids), full_text[len(prefix_text) :])
        if final:
            return ""
        # Nothing new yet (e.g. a skipped special token) or a character is still incomplete.
        self._drop_blank(first_new, full_text)
        if len(self._ids) - self._read_offset > MAX_HELD_TOKENS:
            return self._release(prefix_text, full_text)
        return ""

    def _advance(self, split: int, delta: str) -> str:
        """Mark ``self._ids[:split]`` emitted; the newest emitted tokens become the context.

        At most :data:`PROMPT_CONTEXT_TOKENS` of them: the text before ``split`` is final, and a
        context that starts inside a character only decodes to replacement characters that no
        later byte can change, so a short context keeps ``prefix_text`` a prefix of the window's.
        """
        drop = max(self._read_offset, split - PROMPT_CONTEXT_TOKENS)
        del self._ids[:drop]
        self._read_offset = split - drop
        self._context_text = None
        return delta

    def _drop_blank(self, first_new: int, full_text: str) -> None:
        """Drop new tokens that add no text, now or later: they would only grow the window.

        A token that decodes to nothing on its own carries no bytes (a skipped special token, an
        id outside the tokenizer), so it cannot finish a character later either. The check in
        context guards decoders where a lone token's text differs from its text in context
        (SentencePiece's word-start marker decodes to "" alone and to " " after a word).
        """
        new = range(max(first_new, self._read_offset), len(self._ids))
        blank = {i for i in new if self._is_blank(self._ids[i])}
        if not blank:
            return
        # Only behind text of their own: at the very start, a decoder may strip what comes first
        # (SentencePiece's leading space), so a token that adds nothing there may add text later.
        if not self._context_text and not self._decode(self._ids[: min(blank)]):
            return
        kept = [t for i, t in enumerate(self._ids) if i not in blank]
        if self._decode(kept) == full_text:
            self._ids = kept

    def _is_blank(self, token_id: int) -> bool:
        if token_id not in self._blank:
            self._blank[token_id] = self._decode([token_id]) == ""
        return self._blank[token_id]

    def _release(self, prefix_text: str, full_text: str) -> str:
        """Emit the text before the newest few held tokens, where that text cannot change.

        A split is safe when its two sides decode separately to exactly the full text and the
        kept side has text of its own: its first byte then already decided how the bytes before
        the split decode (they end a character or were invalid), so later tokens cannot change
        them. If no split among the tried ones is safe (a decoder that is not byte-local), the
        whole held text is emitted, as a flush would: the bound wins over exactness there.

        Held tokens that add no text at all (ones :meth:`_drop_blank` could not check, behind a
        context without text) are dropped instead, and the context stays: a SentencePiece decoder
        strips the first space of what it decodes, so the context must keep its first word.
        """
        if full_text == prefix_text and not prefix_text.endswith(REPLACEMENT_CHAR):
            del self._ids[self._read_offset :]
            return ""
        for keep in range(MIN_KEPT_TOKENS, MIN_KEPT_TOKENS + RELEASE_SPLIT_TRIES):
            split = len(self._ids) - keep
            if split <= self._read_offset:
                break
            head, tail = self._decode(self._ids[:split]), self._decode(self._ids[split:])
            if tail and head + tail == full_text and head.startswith(prefix_text):
                return self._advance(split, head[len(prefix_text) :])
        return self._advance(len(self._ids), full_text[len(prefix_text) :])


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
