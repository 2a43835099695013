"""Build (once, cached) and call the C paged-decode kernel in ``decode_kernel.c``.

The kernel is plain C with no torch headers, so building it takes about a second with the system C
compiler, and calling it through ctypes releases the GIL. The shared object is cached under
``$PLUGSERVE_CACHE_DIR`` (default ``~/.cache/plugserve``) keyed by a hash of the source, the flags
and the CPU's feature flags, so a changed source or another machine never reuses a stale build.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_kernel.c")
# -march=native: the build happens on the machine that runs it. Reassociation lets gcc vectorise
# the dot products (the result differs from SDPA's order by float rounding only); no -ffast-math,
# so expf and inf/nan handling stay IEEE.
CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math",
          "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast", "-pthread"]
# OpenMP, so that the kernel's threads are torch's own (see the kernel); a compiler without it (clang
# lacking libomp) builds the pthread variant instead.
OPENMP_FLAGS = ["-fopenmp"]


#: K/V cache element types the kernel reads.
KV_DTYPES = (torch.float32, torch.bfloat16)


class KernelUnavailable(RuntimeError):
    """The C kernel cannot be built or loaded here (no compiler, or the build failed)."""


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc`` / ``gcc`` / ``clang`` on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("PLUGSERVE_CACHE_DIR") or Path.home() / ".cache" / "plugserve") / "kernels"


def _build_key(cc: str) -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join([cc, *CFLAGS, *OPENMP_FLAGS]).encode())
    try:  # -march=native depends on the CPU: a cache dir shared between machines must not mix builds
        digest.update(Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].encode())
    except (OSError, IndexError):
        pass
    return digest.hexdigest()[:16]


@lru_cache(maxsize=1)
def load_kernel() -> ctypes.CDLL:
    """Build the kernel if no cached build exists, load it and declare its signature."""
    cc = compiler()
    if cc is None:
        raise KernelUnavailable("no C compiler found (set $CC or install gcc)")
    target = cache_dir() / f"cpu_paged_decode-{_build_key(cc)}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build into a temporary name and rename: concurrent processes never load a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        for extra in (OPENMP_FLAGS, []):
            proc = subprocess.run([cc, *CFLAGS, *extra, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
            if proc.returncode == 0:
                break
        if proc.returncode != 0:
            os.unlink(tmp)
            raise KernelUnavailable(f"building {SOURCE.name} with {cc} failed:\n{proc.stderr.strip()}")
        os.replace(tmp, target)
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_attention
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, p, i64, p, p, i64, i64, i64, i64, ctypes.c_float, i64, i64]
    fn.restype = ctypes.c_int
    lib.paged_decode_uses_openmp.argtypes = []
    lib.paged_decode_uses_openmp.restype = ctypes.c_int
    return lib


def kernel_threading() -> str:
    """``"openmp"`` when the kernel's threads are the process's OpenMP workers (torch's, when torch
    loaded libgomp first), ``"pthreads"`` when the compiler had no OpenMP and it starts its own."""
    return "openmp" if load_kernel().paged_decode_uses_openmp() else "pthreads"


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                           req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, scale: float,
                           num_threads: int) -> None:
    """Write softmax(q k^T * scale) v of each request's first ``lens[b]`` tokens into ``out``.

    ``q``/``out`` ``[bs, heads, head_dim]`` fp32; ``k_cache``/``v_cache`` ``[slots, kv_heads,
    head_dim]``, both fp32 or both bf16 (read widened to fp32); ``req_to_token`` ``[rows, stride]``
    int32; ``rows``/``lens`` ``[bs]`` int64. Every tensor must be contiguous on the CPU (checked: a
    wrong layout would read garbage).
    """
    kv_dtype = k_cache.dtype if k_cache.dtype in KV_DTYPES else torch.float32
    for name, t, dtype in (("q", q, torch.float32), ("k_cache", k_cache, kv_dtype),
                           ("v_cache", v_cache, kv_dtype), ("out", out, torch.float32),
                           ("req_to_token", req_to_token, torch.int32), ("rows", rows, torch.int64),
                           ("lens", lens, torch.int64)):
        if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name}: need a contiguous CPU {dtype} tensor, got {t.dtype} on {t.device}")
    bs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    status = load_kernel().paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), req_to_token.data_ptr(),
        req_to_token.shape[1], rows.data_ptr(), lens.data_ptr(), bs, num_heads, kv_heads, head_dim,
        float(scale), num_threads, int(kv_dtype == torch.bfloat16),
    )
    if status != 0:
        raise RuntimeError(f"paged_decode_attention failed with status {status} (out of memory or bad head counts)")
