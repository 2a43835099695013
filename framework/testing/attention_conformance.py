"""A conformance kit for attention backends: any backend against plain SDPA on unpaged K/V.

A backend author runs it from their own test suite in two lines::

    from framework.testing.attention_conformance import assert_conformant

    def test_my_backend_conforms():
        assert_conformant(MyBackend.create)            # or assert_conformant("my_backend")

or, one pytest item per case::

    @pytest.mark.parametrize("case", conformance_cases(), ids=str)
    def test_my_backend(case):
        assert_case_conformant(MyBackend.create, case)

The kit builds its own paged KV cache, request table (rows pre-filled with stale slot numbers, pages
handed out in shuffled order) and :class:`ForwardBatch` objects, drives the backend through three
scenarios, and compares every output with ``scaled_dot_product_attention`` in float64 over each
request's contiguous K/V history. It also checks that the new K/V landed in the cache at the slots
the request table names. A backend that offers its decode attention to C
(:meth:`~framework.attention.base.AttentionBackend.native_decode`) has every decode step's layers
run through that function too, on the same q/k/v: its outputs must equal ``forward``'s bit for bit.
The scenarios:

- ``extend``: one batch of fresh prompts of mixed lengths (1 .. 33 tokens, crossing pages), three of
  them of equal length next to each other (backends may batch those);
- ``prefix``: extends on top of cached prefixes (mixed with a fresh prompt in the same batch), a
  request that starts with another one's pages (a radix-cache hit), then a further chunk on top;
- ``decode``: mixed context lengths (1 .. 63), several steps across page boundaries, then a
  reordered subset of the requests;
- ``mixed``: a mixed step (``scheduler.mixed_chunk``): running requests' one-token decode rows in
  the same extend batch as a fresh prompt's chunk and a continuing chunk, twice, then in the
  scheduler's own layout (the prompt first, the decode rows last).

over a grid of page sizes (1, 16), GQA ratios (1, 4, 8), head dims (64, 128) and dtypes (float32
plus the half types the device supports), each with its own tolerance.
"""

from __future__ import annotations

import ctypes
import random
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from framework.attention.base import Attention, AttentionBackend, NativeDecodeAttention
from framework.executor.forward_batch import ForwardBatch, ForwardMode
from framework.memory.kv_cache import KVCache

SCENARIOS = ("extend", "prefix", "decode", "mixed")
PAGE_SIZES = (1, 16)
#: (num_heads, num_kv_heads): GQA ratios 1, 4 and 8, always with two KV heads so head mapping matters.
HEAD_LAYOUTS = ((2, 2), (8, 2), (16, 2))
HEAD_DIMS = (64, 128)
#: Max abs error allowed per dtype. Outputs are convex combinations of N(0, 1) values, so |out| < ~3;
#: the half-type bounds are a few ulps of the output, the fp32 bound leaves room for fused kernels.
DEFAULT_TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}
NUM_LAYERS = 2

BackendFactory = Callable[[Any, Any], AttentionBackend]


def default_dtypes(device: str | torch.device = "cpu") -> list[torch.dtype]:
    """float32 plus the half types ``device`` computes in (CUDA bf16 only where the GPU has it)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return [torch.float32, torch.float16]
    return [torch.float32, torch.bfloat16, torch.float16]


@dataclass(frozen=True)
class ConformanceCase:
    """One point of the grid: a scenario with one shape and dtype."""

    scenario: str
    page_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.scenario}-page{self.page_size}-h{self.num_heads}kv{self.num_kv_heads}-d{self.head_dim}-{dtype}"


def conformance_cases(
    device: str | torch.device = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    scenarios: Iterable[str] = SCENARIOS,
    page_sizes: Iterable[int] = PAGE_SIZES,
    head_layouts: Iterable[tuple[int, int]] = HEAD_LAYOUTS,
    head_dims: Iterable[int] = HEAD_DIMS,
) -> list[ConformanceCase]:
    """The full grid (or the part of it the arguments select), for ``pytest.mark.parametrize``."""
    dtypes = list(dtypes) if dtypes is not None else default_dtypes(device)
    return [
        ConformanceCase(s, p, h, hkv, d, dt)
        for dt in dtypes
        for s in scenarios
        for p in page_sizes
        for (h, hkv) in head_layouts
        for d in head_dims
    ]


@dataclass
class CaseResult:
    """The outcome of one case: worst output and KV-cache errors against the reference."""

    case: ConformanceCase
    max_abs_err: float
    cache_max_abs_err: float
    tolerance: float
    error: str | None = None
    """The exception the backend raised, if it raised; the case then fails."""
    native_checked: int = 0
    """Layer outputs of the backend's ``native_decode`` function compared with ``forward``'s."""
    native_mismatches: int = 0
    """Of those, how many were not bitwise equal (any fails the case)."""

    @property
    def passed(self) -> bool:
        # NaN compares False, so a NaN anywhere fails the case.
        return (self.error is None and self.max_abs_err <= self.tolerance and self.cache_max_abs_err <= self.tolerance
                and self.native_mismatches == 0)

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        line = f"{verdict}  {self.case!s:<40} max_abs_err={self.max_abs_err:.3g} "
        line += f"cache_err={self.cache_max_abs_err:.3g} tol={self.tolerance:.3g}"
        if self.native_checked:
            line += f" native_decode_mismatches={self.native_mismatches}/{self.native_checked}"
        return line + (f"  raised: {self.error.splitlines()[-1]}" if self.error else "")


@dataclass
class ConformanceReport:
    """Every case's result; ``passed`` when all passed. ``str(report)`` is a readable table."""

    backend: str
    results: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.passed]

    def __str__(self) -> str:
        head = f"attention conformance of {self.backend}: {len(self.results) - len(self.failures)}"
        head += f"/{len(self.results)} cases pass"
        return "\n".join([head, *(str(r) for r in self.results)])


class _Pages:
    """Whole pages per request, handed out in shuffled order so slots are never simply contiguous."""

    def __init__(self, num_pages: int, page_size: int, seed: int) -> None:
        self.page_size = page_size
        self.free = list(range(1, num_pages + 1))  # page 0 is the cache's padding page
        random.Random(seed).shuffle(self.free)
        self.pages: dict[int, list[int]] = {}

    def slots(self, row: int, start: int, end: int) -> list[int]:
        pages = self.pages.setdefault(row, [])
        while len(pages) * self.page_size < end:
            pages.append(self.free.pop())
        return [pages[p // self.page_size] * self.page_size + p % self.page_size for p in range(start, end)]


class _Harness:
    """One backend over its own KV cache and request table, plus every request's unpaged K/V history."""

    def __init__(self, factory: BackendFactory, options: Any, case: ConformanceCase, device: torch.device) -> None:
        self.case, self.device, self.dtype = case, device, case.dtype
        num_pages = 512 // case.page_size + 8
        self.kv_cache = KVCache(
            NUM_LAYERS, num_pages, case.page_size, case.num_kv_heads, case.head_dim, case.dtype, device
        )
        gen = torch.Generator().manual_seed(0)
        # Stale slot numbers everywhere: a backend reading past a request's length gets wrong answers.
        self.req_to_token = torch.randint(0, self.kv_cache.num_slots, (8, 256), generator=gen, dtype=torch.int32).to(
            device
        )
        self.pages = _Pages(num_pages, case.page_size, seed=1)
        self.lens: dict[int, int] = {}
        self.history: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.layers = [
            Attention(case.num_heads, case.head_dim, case.head_dim**-0.5, case.num_kv_heads, layer_id=i)
            for i in range(NUM_LAYERS)
        ]
        self.gen = torch.Generator().manual_seed(1234)
        runner = SimpleNamespace(
            device=device, dtype=case.dtype, kv_cache=self.kv_cache, req_to_token=self.req_to_token
        )
        self.backend = factory(runner, options)
        self.max_err = 0.0
        self.cache_err = 0.0
        self.native_checked = 0
        self.native_mismatches = 0

    def _t(self, values: Sequence[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(list(values), dtype=dtype, device=self.device)

    def new_request(self, share_from: int | None = None, shared_len: int = 0) -> int:
        row = len(self.lens)
        self.lens[row] = 0
        if share_from is not None:
            assert shared_len % self.case.page_size == 0
            self.pages.pages[row] = list(self.pages.pages[share_from][: shared_len // self.case.page_size])
            self.req_to_token[row, :shared_len] = self.req_to_token[share_from, :shared_len]
            self.lens[row] = shared_len
            for layer in self.layers:
                k, v = self.history[(layer.layer_id, share_from)]
                self.history[(layer.layer_id, row)] = (k[:shared_len], v[:shared_len])
        return row

    def _batch(self, mode: ForwardMode, rows: Sequence[int], new_lens: Sequence[int]) -> ForwardBatch:
        prefix_lens = [self.lens[r] for r in rows]
        positions, out_loc = [], []
        for row, p, n in zip(rows, prefix_lens, new_lens, strict=True):
            slots = self.pages.slots(row, p, p + n)
            self.req_to_token[row, p : p + n] = self._t(slots, torch.int32)
            positions.extend(range(p, p + n))
            out_loc.extend(slots)
            self.lens[row] = p + n
        seq_lens = [p + n for p, n in zip(prefix_lens, new_lens, strict=True)]
        starts = [sum(new_lens[:i]) for i in range(len(rows))]
        fb = ForwardBatch(
            mode=mode,
            batch_size=len(rows),
            input_ids=torch.zeros(sum(new_lens), dtype=torch.int64, device=self.device),
            positions=self._t(positions),
            req_pool_indices=self._t(rows),
            seq_lens=self._t(seq_lens),
            seq_lens_cpu=seq_lens,
            out_cache_loc=self._t(out_loc),
            req_to_token=self.req_to_token,
            kv_cache=self.kv_cache,
            attn_backend=self.backend,
            logits_indices=self._t([s + n - 1 for s, n in zip(starts, new_lens, strict=True)]),
            extend_prefix_lens_cpu=prefix_lens if mode.is_extend() else None,
            extend_seq_lens_cpu=list(new_lens) if mode.is_extend() else None,
        )
        return fb

    def step(self, mode: ForwardMode, rows: Sequence[int], new_lens: Sequence[int], check: bool = True) -> None:
        """One forward of every layer on random q/k/v; fold the errors into the running maxima."""
        fb = self._batch(mode, rows, new_lens)
        self.backend.init_forward_metadata(fb)
        native = None
        if mode.is_decode() and self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16):
            native = self.backend.native_decode(fb, self.layers, self.dtype)
        case, n = self.case, sum(new_lens)
        h, hkv, d = case.num_heads, case.num_kv_heads, case.head_dim
        for index, layer in enumerate(self.layers):
            q, k, v = (
                torch.randn(n, heads * d, generator=self.gen).to(self.dtype).to(self.device) for heads in (h, hkv, hkv)
            )
            out = self.backend.forward(q, k, v, layer, fb)
            if tuple(out.shape) != (n, h * d) and tuple(out.shape) != (n, h, d):
                raise AssertionError(f"output shape {tuple(out.shape)}, expected {(n, h * d)}")
            if native is not None:
                # Stores the same K/V again, then attends: the same output, bit for bit.
                self.native_checked += 1
                if not torch.equal(call_native_decode(native, index, q, k, v), out.reshape(n, h * d)):
                    self.native_mismatches += 1
            out = out.reshape(n, h, d).detach().to("cpu", torch.float64)
            start = 0
            for row, m in zip(rows, new_lens, strict=True):
                sl = slice(start, start + m)
                # The reference sees exactly what the cache holds: K/V rounded to the cache dtype.
                ki = k[sl].view(m, hkv, d).to("cpu", torch.float64)
                vi = v[sl].view(m, hkv, d).to("cpu", torch.float64)
                old_k, old_v = self.history.get((layer.layer_id, row), (ki[:0], vi[:0]))
                full_k, full_v = torch.cat((old_k, ki)), torch.cat((old_v, vi))
                self.history[(layer.layer_id, row)] = (full_k, full_v)
                if check:
                    ref = _reference(q[sl].view(m, h, d).to("cpu", torch.float64), full_k, full_v, layer.scaling)
                    self.max_err = max(self.max_err, _max_abs(out[sl], ref))
                start += m
        self._check_cache(rows)

    def _check_cache(self, rows: Sequence[int]) -> None:
        for (layer_id, row), (full_k, full_v) in self.history.items():
            if row not in rows:
                continue
            slots = self.req_to_token[row, : full_k.shape[0]].long()
            k_buf, v_buf = self.kv_cache.get_kv(layer_id)
            got_k = k_buf[slots].to("cpu", torch.float64)
            got_v = v_buf[slots].to("cpu", torch.float64)
            self.cache_err = max(self.cache_err, _max_abs(got_k, full_k), _max_abs(got_v, full_v))


_NATIVE_DECODE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


def call_native_decode(native: NativeDecodeAttention, layer: int, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> torch.Tensor:
    """Call a backend's ``native_decode`` function for layer index ``layer`` from Python (what the
    fused decode step does in C); returns its output ``[rows, q's width]``."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    status = _NATIVE_DECODE_FN(native.function)(native.context, layer, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                out.data_ptr())
    if status != 0:
        raise RuntimeError(f"native decode attention of layer {layer} returned status {status}")
    return out


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max())


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain SDPA: queries ``q [n, H, D]`` are the last ``n`` of the ``k, v [S, Hkv, D]`` sequence."""
    n, s = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    mask = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def _run_scenario(hx: _Harness, scenario: str) -> None:
    extend, decode = ForwardMode.EXTEND, ForwardMode.DECODE
    if scenario == "extend":
        rows = [hx.new_request() for _ in range(6)]
        hx.step(extend, rows, [1, 7, 20, 20, 20, 33])
    elif scenario == "prefix":
        rows = [hx.new_request() for _ in range(4)]
        hx.step(extend, rows[:3], [5, 16, 30], check=False)
        rows.append(hx.new_request(share_from=rows[2], shared_len=16))  # a prefix-cache hit
        # rows[3] is fresh: prefixed and unprefixed requests in one batch.
        hx.step(extend, rows, [3, 9, 12, 6, 5])
        hx.step(extend, rows[1:], [1, 17, 4, 2])  # another chunk on a prefix made of two extends
    elif scenario == "decode":
        rows = [hx.new_request() for _ in range(5)]
        hx.step(extend, rows, [1, 9, 16, 40, 63], check=False)
        for _ in range(3):  # the 16 and 63 contexts cross a page boundary here
            hx.step(decode, rows, [1] * len(rows))
        hx.step(decode, [rows[3], rows[0]], [1, 1])  # a reordered subset
    elif scenario == "mixed":
        running = [hx.new_request() for _ in range(3)]
        hx.step(extend, running, [15, 16, 40], check=False)
        fresh, chunked = hx.new_request(), hx.new_request()
        hx.step(extend, [chunked], [10], check=False)
        # decode rows (one token on long contexts) beside a new prompt and a prefix chunk
        hx.step(extend, [*running, fresh, chunked], [1, 1, 1, 24, 17])
        hx.step(extend, [running[2], chunked, running[0]], [1, 6, 1])
        # Scheduler.run_prefill's order: the prompts, then every decode row.
        hx.step(extend, [hx.new_request(), *running], [12, 1, 1, 1])
    else:
        raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")


def _resolve(factory: BackendFactory | str, options: Any) -> tuple[BackendFactory, Any, str]:
    if not isinstance(factory, str):
        name = getattr(factory, "__qualname__", None) or type(factory).__name__
        return factory, options, name
    from framework.plugins import get_registry

    comp = get_registry().get("attention_backend", factory, key="attention.backend")
    return comp.factory, comp.make_options(options), factory


def check_case(
    factory: BackendFactory | str,
    case: ConformanceCase,
    options: Any = None,
    device: str | torch.device = "cpu",
    tolerance: float | None = None,
) -> CaseResult:
    """Run one case; exceptions from the backend are caught and recorded in the result."""
    factory, options, _ = _resolve(factory, options)
    tol = tolerance if tolerance is not None else DEFAULT_TOLERANCES[case.dtype]
    hx = None
    try:
        hx = _Harness(factory, options, case, torch.device(device))
        _run_scenario(hx, case.scenario)
    except Exception:
        err = traceback.format_exc()
        return CaseResult(case, hx.max_err if hx else float("nan"), hx.cache_err if hx else float("nan"), tol, err,
                          hx.native_checked if hx else 0, hx.native_mismatches if hx else 0)
    return CaseResult(case, hx.max_err, hx.cache_err, tol, None, hx.native_checked, hx.native_mismatches)


def run_conformance(
    factory: BackendFactory | str,
    options: Any = None,
    device: str | torch.device = "cpu",
    dtypes: Iterable[torch.dtype] | None = None,
    cases: Iterable[ConformanceCase] | None = None,
    tolerances: dict[torch.dtype, float] | None = None,
) -> ConformanceReport:
    """Check a backend over the grid (or ``cases``) and report max abs error and pass/fail per case.

    ``factory`` is what the backend registers (``factory(runner, options) -> AttentionBackend``) or
    a registered backend name. ``runner`` is a namespace with ``device``, ``dtype``, ``kv_cache``
    and ``req_to_token``; a fresh backend is built for each case.
    """
    factory, options, name = _resolve(factory, options)
    tols = {**DEFAULT_TOLERANCES, **(tolerances or {})}
    cases = list(cases) if cases is not None else conformance_cases(device, dtypes)
    report = ConformanceReport(name)
    for case in cases:
        report.results.append(check_case(factory, case, options, device, tols[case.dtype]))
    return report


def assert_conformant(factory: BackendFactory | str, options: Any = None, **kwargs: Any) -> ConformanceReport:
    """:func:`run_conformance`, raising ``AssertionError`` with the failing cases if any fail."""
    report = run_conformance(factory, options, **kwargs)
    if not report.passed:
        lines = [str(r) for r in report.failures]
        first_error = next((r.error for r in report.failures if r.error), None)
        detail = f"\nfirst exception:\n{first_error}" if first_error else ""
        raise AssertionError(
            f"{report.backend} fails {len(lines)}/{len(report.results)} conformance cases:\n"
            + "\n".join(lines)
            + detail
        )
    return report


def assert_case_conformant(
    factory: BackendFactory | str,
    case: ConformanceCase,
    options: Any = None,
    device: str | torch.device = "cpu",
    tolerance: float | None = None,
) -> CaseResult:
    """One case, for ``@pytest.mark.parametrize("case", conformance_cases(), ids=str)``."""
    result = check_case(factory, case, options, device, tolerance)
    if not result.passed:
        raise AssertionError(str(result) + (f"\n{result.error}" if result.error else ""))
    return result
