"""KV page addressing: which bytes of which buffer one transfer moves.

A page's address in a buffer is ``base_ptr + page_index * bytes_per_page`` (buffers ordered per
layer, K then V; see ``KVLayout``). Pages that are consecutive on *both* sides are merged into one
run, so a request whose pages are contiguous costs one transfer per buffer instead of one per page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from framework.disaggregation.base import KVLayout


@dataclass(frozen=True)
class PageRun:
    """``num_pages`` consecutive pages from ``src_page`` on the sender to ``dst_page`` on the receiver."""

    src_page: int
    dst_page: int
    num_pages: int


@dataclass(frozen=True)
class TransferSpan:
    """One contiguous copy: ``nbytes`` from ``src_addr`` to ``dst_addr`` in buffer ``buffer``."""

    buffer: int
    src_addr: int
    dst_addr: int
    nbytes: int


def page_address(base_ptr: int, page: int, bytes_per_page: int) -> int:
    if page < 0:
        raise ValueError(f"page index must be >= 0, got {page}")
    return base_ptr + page * bytes_per_page


def pages_of_slots(slots: Sequence[int], page_size: int) -> list[int]:
    """The pages holding a request's token slots, in position order (one entry per page).

    A request's slots start each page at a page boundary (prefixes are page-aligned), so the page
    of every ``page_size``-th slot is the request's next page.
    """
    return [int(slots[i]) // page_size for i in range(0, len(slots), page_size)]


def merge_page_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[PageRun]:
    """Pair pages position by position and merge those consecutive on both sides."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    runs: list[PageRun] = []
    start = 0
    for i in range(1, len(src_pages) + 1):
        if i < len(src_pages) and src_pages[i] == src_pages[i - 1] + 1 and dst_pages[i] == dst_pages[i - 1] + 1:
            continue
        if i > start:
            runs.append(PageRun(int(src_pages[start]), int(dst_pages[start]), i - start))
        start = i
    return runs


def check_compatible(src: KVLayout, dst: KVLayout) -> None:
    """Both sides must hold the same model's KV in the same format, and move as many bytes per
    token slot as the other takes (the same heads)."""
    if src.identity is not None and dst.identity is not None:
        why = src.identity.mismatch(dst.identity)
        if why:
            raise ValueError(f"the two servers hold different models' KV: {why}")
    if src.num_buffers != dst.num_buffers:
        raise ValueError(f"incompatible KV layouts: {src.num_buffers} buffers vs {dst.num_buffers}")
    if src.whole and dst.whole:
        if src.bytes_per_page != dst.bytes_per_page:
            raise ValueError(f"incompatible KV layouts: {src.num_buffers} buffers x {src.bytes_per_page} bytes/page "
                             f"vs {dst.num_buffers} x {dst.bytes_per_page}")
    elif src.page_size != dst.page_size or src.moved_token_bytes != dst.moved_token_bytes:
        raise ValueError(f"incompatible head slices: {src.page_size} tokens/page x {src.moved_token_bytes} bytes vs "
                         f"{dst.page_size} x {dst.moved_token_bytes}")


def check_pages(layout: KVLayout, pages: Sequence[int], side: str) -> None:
    for p in pages:
        if not 0 < p < layout.num_pages:  # page 0 is the padding page: never transferred
            raise ValueError(f"{side} page {p} is outside 1 .. {layout.num_pages - 1}")


def transfer_spans(src: KVLayout, dst: KVLayout, runs: Sequence[PageRun]) -> list[TransferSpan]:
    """Every copy the runs take, buffer by buffer (layer 0 K, layer 0 V, layer 1 K, ...): one per
    run when both sides move whole pages, else one per token slot (a head slice is strided: the
    heads of one token are contiguous, the next token's are ``token_bytes`` further on)."""
    check_compatible(src, dst)
    for run in runs:
        check_pages(src, range(run.src_page, run.src_page + run.num_pages), "source")
        check_pages(dst, range(run.dst_page, run.dst_page + run.num_pages), "destination")
    if src.whole and dst.whole:
        bpp = src.bytes_per_page
        return [
            TransferSpan(
                buffer=i,
                src_addr=page_address(src.ptrs[i], run.src_page, bpp),
                dst_addr=page_address(dst.ptrs[i], run.dst_page, bpp),
                nbytes=run.num_pages * bpp,
            )
            for i in range(src.num_buffers)
            for run in runs
        ]
    ps, n = src.page_size, src.moved_token_bytes
    return [
        TransferSpan(buffer=i,
                     src_addr=src.ptrs[i] + (run.src_page * ps + t) * src.token_bytes + src.slice_offset,
                     dst_addr=dst.ptrs[i] + (run.dst_page * ps + t) * dst.token_bytes + dst.slice_offset,
                     nbytes=n)
        for i in range(src.num_buffers)
        for run in runs
        for t in range(run.num_pages * ps)
    ]


def slice_slots(layout: KVLayout, pages: Sequence[int]) -> list[int]:
    """The token slots of ``pages`` in page order (what a head-slice copy gathers or scatters)."""
    ps = layout.page_size
    return [p * ps + t for p in pages for t in range(ps)]
