"""Incremental detokenization and stop strings, on a byte-level BPE tokenizer trained here."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from framework.sampling.detokenizer import (
    MAX_HELD_TOKENS,
    PROMPT_CONTEXT_TOKENS,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopStringMatcher,
    backend_decoder,
    find_stop_string_in_tail,
)

SENTENCES = [
    "héllo wörld 日本語 🙂",
    "hello world, hello again and again",
    "日本語のテキストです。",
    "wörld héllo 🙂🙂 naïve café",
    "The quick brown fox jumps over the lazy dog.",
]


def _train_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A small vocabulary (256 bytes + specials + a few merges) keeps many characters split
    # across tokens, which is the case incremental decoding must get right.
    trainer = trainers.BpeTrainer(
        vocab_size=290,
        special_tokens=["<|eos|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>", pad_token="<|pad|>")


TOKENIZER = _train_tokenizer()
VOCAB = len(TOKENIZER)
_BYTE_TO_CHAR = pre_tokenizers.ByteLevel.alphabet()


def byte_tokens(text: str) -> list[int]:
    """One token per UTF-8 byte: the worst case, every multi-byte character split."""
    # ByteLevel maps each byte to one printable character; rebuild that table from the encoder.
    return [TOKENIZER.convert_tokens_to_ids(_byte_char(b)) for b in text.encode()]


def _byte_char(b: int) -> str:
    # GPT-2's byte-to-unicode table: printable latin-1 bytes map to themselves, others shift up.
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    out, pos, k = [], 0, 0
    while pos < len(ids):
        size = chunks[k % len(chunks)] if chunks else 1
        out.append(detok.add(ids[pos : pos + size]))
        pos, k = pos + size, k + 1
    out.append(detok.flush())
    return out


def test_tokenizer_really_splits_characters() -> None:
    assert len(set(_BYTE_TO_CHAR)) == 256
    assert {_byte_char(b) for b in range(256)} == set(_BYTE_TO_CHAR)
    assert TOKENIZER.decode(byte_tokens(SENTENCES[0])) == SENTENCES[0]
    partial = [t for t in TOKENIZER.encode(" ".join(SENTENCES)) if REPLACEMENT_CHAR in TOKENIZER.decode([t])]
    assert partial, "the fixture should produce tokens that are part of a character"


@settings(max_examples=150, deadline=None)
@given(
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=40),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    skip_special=st.booleans(),
)
def test_incremental_equals_full_decode_for_any_ids(ids: list[int], chunks: list[int], skip_special: bool) -> None:
    detok = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=skip_special)
    got = "".join(_stream(detok, ids, chunks))
    assert got == TOKENIZER.decode(ids, skip_special_tokens=skip_special)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, VOCAB + 20), max_size=12), skip_special=st.booleans())
def test_the_backend_decode_equals_the_tokenizers(ids: list[int], skip_special: bool) -> None:
    """The detokenizer calls the Rust backend directly (the wrapper costs more than the decode):
    it must give what ``decode`` gives, ids outside the vocabulary and special tokens included."""
    fast = backend_decoder(TOKENIZER, skip_special)
    assert fast is not None
    assert fast(ids) == TOKENIZER.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)


def test_a_tokenizer_that_decodes_its_own_way_keeps_its_decode() -> None:
    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs) -> str:  # type: ignore[override]
            return super()._decode(token_ids, skip_special_tokens, **kwargs).upper()

    shouting = Shouting(tokenizer_object=TOKENIZER.backend_tokenizer, eos_token="<|eos|>")
    assert backend_decoder(shouting, True) is None
    ids = TOKENIZER.encode("hello world")
    detok = IncrementalDetokenizer(shouting)
    assert detok.add(ids) + detok.flush() == "HELLO WORLD"


_TEXT = st.text(alphabet=st.sampled_from(list("ab héwö日本語🙂.,\n")), max_size=30)


@settings(max_examples=100, deadline=None)
@given(text=_TEXT, split_bytes=st.booleans(), chunks=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_valid_text_streams_without_replacement_chars(text: str, split_bytes: bool, chunks: list[int]) -> None:
    ids = byte_tokens(text) if split_bytes else TOKENIZER.encode(text)
    pieces = _stream(IncrementalDetokenizer(TOKENIZER), ids, chunks)
    assert "".join(pieces) == text
    assert not any(REPLACEMENT_CHAR in p for p in pieces), "an incomplete character was emitted"


def test_partial_characters_are_held_back_until_complete() -> None:
    detok = IncrementalDetokenizer(TOKENIZER)
    pieces = [detok.add([t]) for t in byte_tokens("日🙂")]
    assert pieces == ["", "", "日", "", "", "", "🙂"]
    assert detok.flush() == ""


def test_invalid_bytes_are_flushed_at_the_end() -> None:
    detok = IncrementalDetokenizer(TOKENIZER)
    ids = byte_tokens("日")[:2]  # a character that never completes
    assert detok.add(ids) == ""
    assert detok.flush() == REPLACEMENT_CHAR == TOKENIZER.decode(ids)


@pytest.mark.parametrize("prompt", ["héllo ", "日本", "wörld 🙂 "])
def test_prompt_gives_context_and_is_not_repeated(prompt: str) -> None:
    prompt_ids = TOKENIZER.encode(prompt)
    out_ids = byte_tokens("wörld 日本語 🙂") + TOKENIZER.encode(" café")
    got = "".join(_stream(IncrementalDetokenizer(TOKENIZER, prompt_ids), out_ids, [1]))
    full = TOKENIZER.decode(prompt_ids + out_ids)
    assert got == full[len(TOKENIZER.decode(prompt_ids)) :]


def test_special_tokens_follow_skip_special_tokens() -> None:
    eos = TOKENIZER.eos_token_id
    ids = TOKENIZER.encode("héllo") + [eos] + byte_tokens(" 日")
    kept = "".join(_stream(IncrementalDetokenizer(TOKENIZER, skip_special_tokens=False), ids, [1]))
    skipped = "".join(_stream(IncrementalDetokenizer(TOKENIZER, skip_special_tokens=True), ids, [1]))
    assert kept == "héllo<|eos|> 日" and skipped == "héllo 日"


# ---------------------------------------------------------------------------------------------------
# Stop strings


def _reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Truncate at the stop occurrence that is completed first (earliest start on a tie)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[: end - len(stop)], stop
    return text, None


def _feed_all(stops: list[str], deltas: list[str]) -> tuple[list[str], StopStringMatcher]:
    matcher = StopStringMatcher(stops)
    out = [matcher.feed(d) for d in deltas]
    out.append(matcher.flush())
    return out, matcher


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=30),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_matcher_truncates_like_the_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    pieces, matcher = _feed_all(stops, deltas)
    want, stop = _reference_stop(text, stops)
    assert "".join(pieces) == want
    assert matcher.stopped == (stop is not None) and matcher.matched_stop == stop
    # Emitted text is final: no stop string ever appears in it, even across chunk borders.
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert not any(s in emitted for s in stops)
    assert "".join(_feed_all(stops, list(text))[0]) == want, "result depends on chunking"


def test_stop_matcher_holds_back_a_possible_stop_prefix() -> None:
    matcher = StopStringMatcher(["</s>", "STOP"])
    assert matcher.feed("hello </") == "hello "
    assert matcher.feed("b>") == "</b>"
    assert matcher.feed(" ST") == " "
    assert matcher.feed("OP and more") == ""
    assert matcher.stopped and matcher.matched_stop == "STOP"
    assert matcher.feed("ignored") == "" and matcher.flush() == ""
    open_end = StopStringMatcher(["STOP"])
    assert open_end.feed("the end ST") == "the end " and open_end.flush() == "ST"


@pytest.mark.parametrize(
    ("stop", "want"),
    [("wö", "héllo "), ("本語 ", "héllo wörld 日"), ("🙂", "héllo wörld 日本語 "), ("lo w", "hél")],
)
def test_stop_strings_spanning_tokens_with_the_detokenizer(stop: str, want: str) -> None:
    ids = byte_tokens("héllo wörld ") + TOKENIZER.encode("日本語 🙂 more text")
    detok, matcher = IncrementalDetokenizer(TOKENIZER), StopStringMatcher([stop])
    emitted = []
    for i, t in enumerate(ids):
        emitted.append(matcher.feed(detok.add([t])))
        hit = find_stop_string_in_tail(TOKENIZER, ids[: i + 1], [stop], len(stop))
        assert hit == (stop in TOKENIZER.decode(ids[: i + 1])), f"token {i}"
        if hit:
            break
    assert matcher.stopped and "".join(emitted) == want


def test_find_stop_string_in_tail_decodes_only_a_window() -> None:
    seen: list[int] = []

    class Counting:
        def decode(self, ids: list[int], **kwargs: object) -> str:
            seen.append(len(ids))
            return TOKENIZER.decode(ids, **kwargs)

    ids = byte_tokens("a long output " * 50 + "日本 END")
    assert find_stop_string_in_tail(Counting(), ids, ["END", "x"], 3)
    assert seen == [4 * 3 + 2]
    assert not find_stop_string_in_tail(Counting(), ids, [], 3)
    assert not find_stop_string_in_tail(Counting(), ids[:-1], ["END"], 3)


# ---------------------------------------------------------------------------------------------------
# Long runs that print nothing: the decoded window must stay bounded (issue 21, item 8)


class CountingTokenizer:
    """Wraps the tokenizer and records the length of every window it is asked to decode."""

    def __init__(self) -> None:
        self.window_sizes: list[int] = []

    def decode(self, ids: list[int], **kwargs: object) -> str:
        self.window_sizes.append(len(ids))
        return TOKENIZER.decode(ids, **kwargs)


_RUN = 2000
_EOS = TOKENIZER.eos_token_id
_E6, _97, _9C = byte_tokens("日")
_CONT = byte_tokens("\x80".encode("latin-1").decode("latin-1"))[1]  # the byte 0x80 on its own

ADVERSARIAL_RUNS = {
    "skipped_special_tokens": [_EOS] * _RUN,
    "ids_outside_the_tokenizer": [VOCAB + i for i in range(_RUN)],
    "stray_continuation_bytes": [_CONT] * _RUN,
    "unfinished_lead_bytes": [_E6] * _RUN,
    "character_split_by_special_tokens": [_E6] + [_EOS] * _RUN + [_97, _9C],
    "character_split_by_unknown_ids": [_E6, _97] + [VOCAB + 7] * _RUN + [_9C],
    "specials_between_stray_bytes": [_CONT, _EOS] * (_RUN // 2),
}


def test_continuation_byte_fixture() -> None:
    assert TOKENIZER.decode([_CONT] * 3) == REPLACEMENT_CHAR * 3
    assert TOKENIZER.decode([_E6, _97, _9C]) == "日"


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("name", sorted(ADVERSARIAL_RUNS))
def test_unprintable_runs_decode_a_bounded_window(name: str, chunk: int) -> None:
    ids = TOKENIZER.encode("héllo ") + ADVERSARIAL_RUNS[name] + byte_tokens(" wörld 日本")
    counting = CountingTokenizer()
    got = "".join(_stream(IncrementalDetokenizer(counting, skip_special_tokens=True), ids, [chunk]))
    assert got == TOKENIZER.decode(ids, skip_special_tokens=True)
    # Without a bound the window grows to the whole run (2,000+ ids) and the total work is
    # quadratic; with it, every decode is short and the number of decodes linear.
    assert max(counting.window_sizes) <= PROMPT_CONTEXT_TOKENS + MAX_HELD_TOKENS + chunk, max(counting.window_sizes)
    assert len(counting.window_sizes) <= 4 * len(ids)
    assert sum(counting.window_sizes) <= 40 * len(ids)


def test_kept_special_tokens_are_text_not_blank() -> None:
    ids = [_EOS] * 100 + TOKENIZER.encode("ok")
    got = "".join(_stream(IncrementalDetokenizer(TOKENIZER, skip_special_tokens=False), ids, [1]))
    assert got == TOKENIZER.decode(ids, skip_special_tokens=False) == "<|eos|>" * 100 + "ok"


_UNPRINTABLE = st.sampled_from([_CONT, _E6, _97, _9C, _EOS, VOCAB + 3])


@settings(max_examples=150, deadline=None)
@given(
    runs=st.lists(st.tuples(_UNPRINTABLE, st.integers(1, 90)), max_size=4),
    text=st.lists(st.integers(0, VOCAB - 1), max_size=10),
    chunks=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    skip_special=st.booleans(),
)
def test_long_runs_still_equal_full_decode(
    runs: list[tuple[int, int]], text: list[int], chunks: list[int], skip_special: bool
) -> None:
    ids = [t for token, n in runs for t in [token] * n] + text + [t for token, n in runs[:1] for t in [token] * n]
    detok = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=skip_special)
    assert "".join(_stream(detok, ids, chunks)) == TOKENIZER.decode(ids, skip_special_tokens=skip_special)


def _sentencepiece_like() -> PreTrainedTokenizerFast:
    """Metaspace ("▁" for a space) with the leading space of the decoded text stripped, as the
    Llama 2 / Mistral tokenizers do: a lone "▁" decodes to "" but to " " after other text."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"], show_progress=False)
    tok.train_from_iterator(SENTENCES * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("run", [2, 40, 400])
def test_word_start_marker_before_a_long_blank_run_keeps_its_space(run: int) -> None:
    sp = _sentencepiece_like()
    space, oov = sp.convert_tokens_to_ids("▁"), len(sp) + 1
    assert sp.decode([space]) == "" and sp.decode([space, space]) == " "
    ids = [space] * 3 + [oov] * run + sp.encode(" hello world", add_special_tokens=False) + [space, sp.eos_token_id]
    for prompt in (None, sp.encode("wörld", add_special_tokens=False)):
        got = "".join(_stream(IncrementalDetokenizer(sp, prompt), ids, [1]))
        full = sp.decode((prompt or []) + ids, skip_special_tokens=True)
        assert got == full[len(sp.decode(prompt or [], skip_special_tokens=True)) :], (prompt, got)
