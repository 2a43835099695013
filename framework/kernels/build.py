"""Build a C source into a shared library once, cache it, and load it with ctypes.

The kernels are plain C with no torch headers, so a build takes about a second with the system C
compiler, and a ctypes call releases the GIL. Builds are cached under ``$PLUGSERVE_CACHE_DIR``
(default ``~/.cache/plugserve``) keyed by a hash of the source, the shared headers of this directory
(``cpu_float.h``, on every build's include path), the compiler, the flags and the CPU's feature flags,
so a changed source or header, or another machine, never reuses a stale build.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

# OpenMP, so that a kernel's threads are torch's own: inside torch's process ``libgomp.so.1`` is
# matched by soname to the runtime torch already loaded. A compiler without OpenMP (clang lacking
# libomp) builds without it; sources then fall back to pthreads or one thread.
OPENMP_FLAGS = ["-fopenmp"]

#: Headers the kernels share (``#include "cpu_float.h"``); every build gets ``-I`` of this directory.
INCLUDE_DIR = Path(__file__).parent

logger = logging.getLogger(__name__)


class KernelUnavailable(RuntimeError):
    """A C kernel cannot be built or loaded here (no compiler, or the build failed)."""


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc`` / ``gcc`` / ``clang`` on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("PLUGSERVE_CACHE_DIR") or Path.home() / ".cache" / "plugserve") / "kernels"


def _build_key(source: Path, cc: str, cflags: Sequence[str]) -> str:
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(INCLUDE_DIR.glob("*.h")):
        digest.update(header.read_bytes())
    digest.update(" ".join([cc, *cflags, *OPENMP_FLAGS]).encode())
    try:  # -march=native depends on the CPU: a cache dir shared between machines must not mix builds
        digest.update(Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].encode())
    except (OSError, IndexError):
        pass
    return digest.hexdigest()[:16]


def build_and_load(source: Path, name: str, cflags: Sequence[str]) -> ctypes.CDLL:
    """Compile ``source`` with ``cflags`` (plus OpenMP when the compiler has it) into the cache
    unless a build for exactly this source, compiler and CPU is there; load and return it."""
    cc = compiler()
    if cc is None:
        raise KernelUnavailable("no C compiler found (set $CC or install gcc)")
    target = cache_dir() / f"{name}-{_build_key(source, cc, cflags)}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build into a temporary name and rename: concurrent processes never load a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        for extra in (OPENMP_FLAGS, []):
            proc = subprocess.run([cc, *cflags, *extra, f"-I{INCLUDE_DIR}", str(source), "-o", tmp, "-lm"],
                                  capture_output=True, text=True)
            if proc.returncode == 0:
                break
        if proc.returncode != 0:
            os.unlink(tmp)
            raise KernelUnavailable(f"building {source.name} with {cc} failed:\n{proc.stderr.strip()}")
        os.replace(tmp, target)
    return ctypes.CDLL(str(target))


def load_optional(source: Path, name: str, cflags: Sequence[str], what: str) -> ctypes.CDLL | None:
    """:func:`build_and_load`, or ``None`` (logged) when there is no compiler or no writable cache
    directory: for kernels whose callers fall back to torch ops."""
    try:
        return build_and_load(source, name, cflags)
    except (KernelUnavailable, OSError) as exc:
        logger.info("%s unavailable, using torch ops: %s", what, exc)
        return None
