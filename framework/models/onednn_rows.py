"""Row counts for oneDNN's packed GEMMs: bucketed, so its primitive caches stay bounded.

Used by :mod:`framework.models.cpu_linear`; the reasons and the measurements are on
:func:`bucket_rows`.
"""

from __future__ import annotations

import math

import torch

#: Row counts up to this many reach oneDNN as they are; larger ones are padded (see ``bucket_rows``).
_EXACT_ROWS = 32


def bucket_rows(rows: int) -> int:
    """The row count a packed GEMM of ``rows`` rows runs at: ``rows`` itself up to 32, else rounded
    up to a multiple of an eighth of its power of two (33..64 in steps of 4, 65..128 in steps of 8,
    ..., 513..1024 in steps of 64), and of a sixteenth above 1024 rows (1025..2048 in steps of 64):
    at most 12.5% more rows (6.25% above 1024), zeros, sliced off the result.

    Why: oneDNN builds (JIT-compiles) a primitive per input shape, and torch keeps them in two LRU
    caches of 1024 entries (ideep's ``LRU_CACHE_CAPACITY`` and oneDNN's
    ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``). With every prefill batch a new row count both caches
    evicted on most calls, and the primitives allocated and freed between each step's tensors
    fragmented glibc's heap: the scheduler's idle RSS rose by 425 MB over 10k requests and was
    still rising (``scripts/soak/scheduler_memory.py``, embedded model; the heap's free bytes grew
    while its live bytes stayed flat). Bucketed, a CPU server with the default budgets (a prefill
    <= 1024 rows, a mixed step <= 1792 with its decode rows) has at most 85 row counts per layer
    shape (~510 primitives for a Llama's six GEMM kinds), so the caches stop evicting. A row's result
    does not depend on the row count (fp32 here: bitwise equal), so the padding changes no output.

    Why finer above 1024: the 64-stream served workload's mixed steps run ~1700 rows, which the
    eighths padded to 1792 (~4% of their GEMM work on zeros). With sixteenths, in process on the
    Sapphire Rapids host (llama-120m fp32, 64 in flight over 256 requests, alternating): those
    steps took 1106-1110 ms against 1153-1160, and the run 374.8-376.6 tok/s against 366.5-367.1.
    """
    if rows <= _EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - (5 if rows > 1024 else 4))
    return -(-rows // step) * step


def padded_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as contiguous 2-D rows, extra rows appended up to ``bucket_rows``: zeros in a copy, or,
    without copying, the tensor ``x`` is the leading rows of (see :func:`padded_empty`).

    Why the second form: a 1713-row mixed step copied 67 activations into their buckets (each GEMM's
    input, and the residual its add post-op reads), 12.7 ms of a 237 ms bf16 step on the Sapphire
    Rapids host. Every GEMM output here comes out bucketed and is handed on as its leading rows
    (:func:`unpadded`), so the next GEMM takes the whole buffer back. What the extra rows hold is
    then whatever the GEMM made of its own padding (finite values), not zeros: a GEMM row depends on
    its input row alone, and those output rows are sliced off, so no kept result changes.
    """
    x = x.reshape(-1, x.shape[-1])
    rows = x.shape[0]
    target = bucket_rows(rows)
    if target == rows:
        return x.contiguous()
    cols = x.shape[1]
    # Storage, not ``x._base``: tensors made under inference mode keep no view base.
    if (x.is_contiguous() and x.storage_offset() == 0
            and x.untyped_storage().nbytes() == target * cols * x.element_size()):
        return x.as_strided((target, cols), (cols, 1))
    out = x.new_empty((target, cols))
    out[:rows] = x
    out[rows:].zero_()
    return out


def padded_empty(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A new ``[rows, cols]`` tensor (contents unset) that is the leading rows of a ``bucket_rows``
    buffer whose extra rows are zeros, so that :func:`padded_rows` hands a packed GEMM the buffer
    without a copy. For activations that feed a packed GEMM (the norms' outputs, attention's)."""
    target = bucket_rows(rows)
    if target == rows:
        return torch.empty(rows, cols, dtype=dtype)
    buffer = torch.empty(target, cols, dtype=dtype)
    buffer[rows:].zero_()  # never-written memory could hold NaNs or denormals; zeros cost nothing
    return buffer[:rows]


def unpadded(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The rows of ``y`` that belong to ``like``'s rows, in ``like``'s leading shape (a view)."""
    lead = like.shape[:-1]
    return y[: math.prod(lead)].view(*lead, y.shape[-1])
