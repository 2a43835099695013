"""CPU memory on 2 MiB pages for what a decode step streams (the small-GEMM weights front to back;
the KV cache's rows wherever the requests' slots are).

Why: a decode step of a few rows reads every weight once and is bound by how fast the cores stream
memory. On 4 KiB pages the hardware prefetchers stop at each page boundary and every page takes a
TLB entry (a 0.5 GB weight copy spans ~130k pages); on 2 MiB pages a stream runs 512 times as far
between boundaries. On the Zen 4 host, llama-120m's 49 fp32 linears at one row took 0.92-0.96x the
time with their weights on 2 MiB pages, 0.93-0.95x at four rows, 0.95-0.99x at 16 (same process,
alternating; see docs/benchmarks.md).

How: Linux's transparent huge pages in ``madvise`` mode (Debian's default) back a region with huge
pages only if it asks (``MADV_HUGEPAGE``) before its pages are first touched; memory touched before
stays on small pages until ``khugepaged`` gets to it, minutes later (``MADV_COLLAPSE`` does it at
once but measured 2.5 s per GB). So the buffer is mapped untouched, marked, then filled. Best
effort: where THP is ``never`` or absent the buffer is plain memory, and the values never differ.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from functools import lru_cache
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
"""Bytes in a transparent huge page (x86-64, and arm64 with 4 KiB base pages)."""
_PAGE = 4096
_MADV_HUGEPAGE = 14
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``), or None
    where there is none to read (not Linux, or a kernel without THP)."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def huge_pages_available() -> bool:
    """Whether a region that asks gets huge pages here (THP ``always`` or ``madvise``)."""
    return _madvise() is not None and thp_mode() in ("always", "madvise")


@lru_cache(maxsize=1)
def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    fn = getattr(ctypes.CDLL(name, use_errno=True), "madvise", None) if name else None
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


def empty_on_huge_pages(nbytes: int) -> torch.Tensor:
    """A zero-filled CPU byte tensor of ``nbytes`` starting on a 2 MiB boundary, in a mapping of its
    own marked for huge pages before anything touches it (2 MiB more is mapped, for the alignment;
    unmapped when the tensor is freed). Not resizable (``torch.frombuffer``). A plain
    ``torch.empty`` where huge pages are not available or ``nbytes`` is under one.

    A mapping of its own, not a block of the C heap: a heap block may reuse pages already touched,
    which stay small, and with ``device.cpu_keep_freed_memory`` every block comes from the heap."""
    if nbytes < HUGE_PAGE or not huge_pages_available():
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe = ctypes.c_char.from_buffer(region)
    address = ctypes.addressof(probe)
    del probe  # its export of the buffer, so torch's is the only one
    offset = -address % HUGE_PAGE
    # Whole 4 KiB pages of what the caller gets (+ the slack after it, which is ours too).
    length = (len(region) - offset) // _PAGE * _PAGE
    _madvise()(address + offset, length, _MADV_HUGEPAGE)  # a refusal leaves small pages: no harm
    # The tensor holds the mapping (torch keeps its buffer export until the storage dies).
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages on the whole 2 MiB pages inside ``t``'s memory (a CPU tensor, before its
    pages are first touched: pages already touched stay small until ``khugepaged``). Unlike
    :func:`empty_on_huge_pages` the tensor stays an ordinary allocation (its storage can be resized
    and freed, as the memory saver does with the KV cache). Returns whether the advice was given."""
    if t.device.type != "cpu" or not huge_pages_available():
        return False
    start = t.data_ptr()
    end = start + t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return False
    return _madvise()(first, last - first, _MADV_HUGEPAGE) == 0


def huge_page_bytes(t: torch.Tensor) -> int | None:
    """Bytes of ``t``'s memory the kernel backs with huge pages now (from ``/proc/self/smaps``:
    ``AnonHugePages`` of the mappings it overlaps, so a mapping shared with other data counts
    whole), or None where there is no smaps to read. For tests and diagnostics."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, overlaps = 0, False
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            start, _, end = head.partition("-")
            overlaps = int(start, 16) < hi and lo < int(end, 16)
        elif overlaps and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total
