"""The ``device`` section of the configuration schema (:mod:`framework.config.schema`): where the
model runs, and how its linear layers run on CPU."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional


class Device(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class CpuLinear(Enum):
    auto = "auto"
    onednn = "onednn"
    aten = "aten"


class CpuSmallGemm(Enum):
    auto = "auto"
    kernel = "kernel"
    onednn = "onednn"


class CpuPrefillGemm(Enum):
    auto = "auto"
    onednn = "onednn"
    aten = "aten"
    kernel = "kernel"


@dataclass
class DeviceConfig:
    """Where the model runs."""

    device: Device = Device.auto
    """auto: cuda when available, else cpu."""
    num_threads: Optional[int] = None
    """torch intra-op threads on CPU; default: the cores this process may use."""
    seed: int = 0
    """Seed of the global RNG that unseeded sampling uses."""
    cpu_linear: CpuLinear = CpuLinear.auto
    """Linear layers on CPU: onednn (weights pre-packed once for oneDNN, ~1.4-2x faster fp32 GEMM/GEMV;
    bf16 too on CPUs with native bf16 dot products), aten (torch's F.linear) or auto (onednn for the
    models it can pack when torch has it)."""
    cpu_small_gemm: CpuSmallGemm = CpuSmallGemm.auto
    """Linear calls of a few rows (decode steps: up to ``small_gemm.max_rows``, 64 fp32 / 8 bf16 on
    AVX2 builds, 32 fp32 / 24 bf16 on AVX-512 ones, 4 bf16 where oneDNN has AMX) with onednn linears, fp32 or bf16:
    kernel (plugserve's C kernel, on a second copy of the linear weights in its own panel layout;
    1.1-1.5x faster there than oneDNN on the 2-core test hosts), onednn (the packed weights alone),
    or auto (kernel when the copy takes at most a quarter of the memory available at load time)."""
    cpu_prefill_gemm: CpuPrefillGemm = CpuPrefillGemm.auto
    """Linear calls past the small-GEMM kernel's rows (prefills, mixed steps) with onednn linears:
    onednn (the packed weights), aten (torch's ``F.linear``, i.e. MKL's sgemm, from 256 rows on a
    dense copy of the weights kept for it: one more copy), kernel (plugserve's blocked C GEMM on the
    small-GEMM kernel's copy, fp32 on CPUs with AVX2 and FMA: no more copies), or auto (for fp32 on
    a CPU whose best vector unit torch reports as AVX2: kernel when the small-GEMM copy is kept,
    else aten when its copy takes at most a quarter of the memory available at load time; onednn
    elsewhere). On the AVX2-only Zen 3 host the kernel ran llama-120m's GEMMs ~1.1x faster than
    packed oneDNN at 128 rows and as fast as MKL or faster at 1,024; MKL beat oneDNN from 256 rows
    (1.05-1.2x); on the AVX-512 Zen 4 host oneDNN and MKL measured equal."""
    cpu_fused_decode: bool = True
    """With the small-GEMM kernel on (``cpu_small_gemm``), decode steps of up to
    ``small_gemm.fused_max_rows`` rows (64 fp32 / 48 bf16 on AVX-512 builds, 14 bf16 with AMX, 64
    fp32 / 8 bf16 on AVX2 ones) run all decoder layers of a Llama-family model in one C call when
    the attention backend offers its decode attention to C (``cpu_paged`` does): the same kernels
    and results as the module path where it runs them, without its per-layer Python work (~2 ms a
    step at batch 1 on a 2-core host, 9-13% of a 48-64-row step). false: layer by layer through the modules."""
    cpu_huge_pages: bool = True
    """The small-GEMM kernel's weight copies (``cpu_small_gemm``) in one buffer on 2 MiB
    transparent huge pages, where Linux offers them (THP ``madvise`` or ``always``): a decode step
    of a few rows streams every weight, and on 4 KiB pages the prefetchers stop at each page
    boundary. 2-5% faster steps at 1-4 rows on the 2-core Zen 4 host, none measurable from 16 rows
    (docs/benchmarks.md). The CPU KV cache's buffers are asked onto huge pages too (a decode step
    reads each request's K/V rows wherever its slots are: 0.94-0.95x the decode attention's time on
    a Sapphire Rapids host). Values are unchanged; false: both stay on the heap's pages."""
    cpu_gemm_warmup: Optional[bool] = None
    """CPU, oneDNN-packed linears: before serving, run each distinct layer shape once at every row
    count a step can bucket to (``framework.models.gemm_warmup``), so that oneDNN's JIT-compiled
    primitives exist before a request needs them (a new bucket's first step took ~25-30 ms longer
    with bf16 llama-120m on a Sapphire Rapids host; the warm-up took 1.4 s, 1.9-2.6 s in fp32). null
    (auto): on in the processes plugserve runs itself (as ``cpu_keep_freed_memory``), off for an
    ``Engine`` inside another program; true / false force it."""
    cpu_gemm_warmup_max_s: float = 10.0
    """The warm-up starts no new row count after this many seconds (smaller counts come first): a
    large model's GEMMs take seconds each, where a first call's few milliseconds matter little."""
    cpu_keep_freed_memory: Optional[bool] = None
    """CPU, glibc: the C heap keeps the blocks a step frees for the next step (``mallopt``: no
    per-block mmap for large blocks, no trimming) instead of unmapping them, which made the kernel
    map and zero-fill every activation of 32 MiB or more again at each step (a 2048-token prefill
    of llama-120m spent 13% of its time there). The resident size stays at the largest step's; a
    memory release still returns freed pages. null (auto): on in the processes plugserve runs
    itself (CLI, server scheduler processes, tensor-parallel ranks), off for an ``Engine`` inside
    another program, since the setting is the whole process's."""
