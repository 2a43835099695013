"""The C heap (glibc's malloc) of a process that runs a model on CPU.

torch takes every CPU tensor from ``malloc``. glibc serves a block of 32 MiB or more (its largest
mmap threshold) from a fresh ``mmap`` and unmaps it again on ``free``, so each such activation is
mapped and zero-filled by the kernel anew at every step: on the Zen 4 host, llama-120m's 2048-token
prefill took 96k page faults and 13% of its time in the kernel, a 4096-token one 332k and 18%
(each 7-9% slower per token than a 1024-token one, whose blocks all stay under the threshold).
:func:`keep_freed_blocks` makes glibc serve every block from the heap and keep what is freed there
for the next step, as tcmalloc and jemalloc (which vLLM and SGLang preload on CPU) do anyway.

The settings belong to the whole process, so plugserve applies them only in processes it runs
itself (:func:`claim_process`: the CLI, the server's scheduler processes, tensor-parallel ranks),
not to an ``Engine`` embedded in another program, unless ``device.cpu_keep_freed_memory`` says so.
A release of memory (``release_memory_occupation``) still returns freed pages: :func:`trim_heap`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import lru_cache

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_NEVER = 2**31 - 1
"""The largest trim threshold mallopt takes: free memory at the heap's top is kept up to 2 GiB."""

_owned = False


@lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    libc = ctypes.CDLL(name)
    # musl and other C libraries have no mallopt with these parameters (or none at all)
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def claim_process() -> None:
    """Mark this process as one plugserve runs itself: ``device.cpu_keep_freed_memory: null``
    then means on (see the module docstring)."""
    global _owned
    _owned = True


def on_for_own_process(setting: bool | None) -> bool:
    """A process-wide setting whose null (auto) means "on in the processes plugserve runs itself,
    off for an ``Engine`` inside another program" (``device.cpu_keep_freed_memory``,
    ``device.cpu_gemm_warmup``); true / false force it."""
    return setting is True or (setting is None and _owned)


def keep_freed_blocks() -> bool:
    """Serve large blocks from the heap (no per-block mmap) and never trim its top, so a freed
    activation is reused by the next step instead of mapped and zero-filled again. The resident
    size then stays at the largest step's. False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_NEVER) == 1
    if ok:
        logger.debug("glibc heap: large blocks from the heap, freed memory kept for reuse")
    return ok


def trim_heap() -> None:
    """Ask glibc to return free heap pages to the OS (``malloc_trim``). Freed tensors under glibc's
    mmap threshold (which rises up to 32 MiB as big blocks are freed), and all of them after
    :func:`keep_freed_blocks`, stay in the heap otherwise, so a release or a repack would not show
    in the resident size. A no-op off glibc."""
    libc = _glibc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
