"""The small-GEMM weight copies on 2 MiB pages (``device.cpu_huge_pages``): where they live, what the
kernel reports about their pages, and that the layers compute the same bytes either way."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from framework.kernels import small_gemm
from framework.kernels.huge_pages import HUGE_PAGE, empty_on_huge_pages, huge_page_bytes, huge_pages_available
from framework.models.cpu_linear import PackedLinear, PackedSwiGLU, onednn_linear_available, pack_linear_layers
from framework.models.layers import FusableSwiGLU, SiluAndMul

needs_thp = pytest.mark.skipif(not huge_pages_available() or huge_page_bytes(torch.empty(1)) is None,
                               reason="no transparent huge pages here (not Linux, or THP set to never)")
needs_kernel = pytest.mark.skipif(not (onednn_linear_available() and small_gemm.kernel_available()),
                                  reason="needs torch's oneDNN linear ops and the small-GEMM kernel")


@needs_thp
def test_buffer_starts_on_a_huge_page_and_gets_huge_pages_once_filled() -> None:
    buf = empty_on_huge_pages(5 * HUGE_PAGE + 123)
    assert buf.dtype == torch.uint8 and buf.numel() == 5 * HUGE_PAGE + 123
    assert buf.data_ptr() % HUGE_PAGE == 0
    buf.fill_(7)  # first touch: the kernel faults the marked range in on 2 MiB pages
    # At least the whole 2 MiB pages inside it (a busy host may be short of free huge pages for
    # a page or two; the assertion leaves room for that, not for none at all).
    assert huge_page_bytes(buf) >= 3 * HUGE_PAGE


_AFTER_KEPT_BLOCKS = """
import torch
from framework.kernels.huge_pages import HUGE_PAGE, empty_on_huge_pages, huge_page_bytes
from framework.memory.heap import keep_freed_blocks
assert keep_freed_blocks()
torch.ones(64 << 20, dtype=torch.uint8).fill_(2)  # a large block, touched and freed into the heap
buf = empty_on_huge_pages(5 * HUGE_PAGE)
buf.fill_(7)
print(huge_page_bytes(buf))
"""


@needs_thp
def test_huge_pages_also_with_the_heap_keeping_freed_blocks() -> None:
    """``device.cpu_keep_freed_memory`` serves every block from the heap, whose pages may have been
    touched already (and stay small): the buffer must come from a mapping of its own (a child
    process, since the heap's settings are the whole process's)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _AFTER_KEPT_BLOCKS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[-1]) >= 3 * HUGE_PAGE


def test_small_requests_are_plain_memory() -> None:
    buf = empty_on_huge_pages(1000)
    assert buf.numel() == 1000 and buf.dtype == torch.uint8


class _Block(nn.Module, FusableSwiGLU):
    """Big enough for its copies to span several 2 MiB pages (fp32: 4.5 MiB + 2.25 MiB + 2.25 MiB)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(768, 1536, bias=True)
        self.gate_up_proj = nn.Linear(768, 2 * 768, bias=False)
        self.down_proj = nn.Linear(768, 768, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(self.qkv(x)[:, :768])))


def _packed(huge_pages: bool) -> _Block:
    torch.manual_seed(0)
    block = _Block()
    pack_linear_layers(block, small_gemm=True, huge_pages=huge_pages)
    return block


def _copies(block: nn.Module) -> list[torch.Tensor]:
    return [m.small_weight.data for m in block.modules()
            if isinstance(m, (PackedLinear, PackedSwiGLU)) and m.small_weight is not None]


@needs_kernel
@needs_thp
def test_copies_share_one_buffer_on_huge_pages_and_compute_the_same() -> None:
    gathered, apart = _packed(True), _packed(False)
    copies = _copies(gathered)
    assert len(copies) == 3
    storages = {c.untyped_storage().data_ptr() for c in copies}
    assert len(storages) == 1, "the copies of one packing share one buffer"
    assert min(c.data_ptr() for c in copies) % HUGE_PAGE == 0
    assert all(c.data_ptr() % 4096 == 0 for c in copies)
    assert sum(huge_page_bytes(c) or 0 for c in copies[:1]) >= 2 * HUGE_PAGE
    # Without it each copy is an allocation of its own, as packing made it.
    assert len({c.untyped_storage().data_ptr() for c in _copies(apart)}) == 3
    for a, b in zip(copies, _copies(apart), strict=True):
        assert torch.equal(a, b)
    x = torch.randn(4, 768)  # 4 rows: the small-GEMM kernel's range, so the copies are what runs
    with torch.no_grad():
        assert torch.equal(gathered(x), apart(x))


@needs_kernel
@needs_thp
def test_a_partial_repack_gathers_every_copy_again() -> None:
    """Repacking one layer (a weight update of that layer) gathers every copy into a new buffer:
    none stays in the old one, so the old one (with the repacked layer's stale slice) is freed."""
    from framework.models.cpu_linear import unpack_linear_layers

    block, reference = _packed(True), _packed(False)
    shared = block.down_proj.small_weight.data.untyped_storage().data_ptr()
    unpack_linear_layers(block, {"qkv"})
    pack_linear_layers(block, small_gemm=True, huge_pages=True)
    now = {m.small_weight.data.untyped_storage().data_ptr() for m in (block.qkv, block.gate_up_proj, block.down_proj)}
    assert len(now) == 1 and shared not in now
    x = torch.randn(4, 768)
    with torch.no_grad():
        assert torch.equal(block(x), reference(x))


_KV_ON_HUGE_PAGES = """
import torch
from framework.kernels.huge_pages import huge_page_bytes
from framework.memory.kv_cache import KVCache
geometry = dict(num_layers=2, num_pages=40959, page_size=1, num_kv_heads=4, head_dim=64, dtype=torch.float32,
                device="cpu")  # 40 MiB a buffer: past glibc's largest mmap threshold, so a fresh mapping
print(*(huge_page_bytes(b) for b in KVCache(**geometry, huge_pages=True).k_buffers))
"""


@needs_thp
def test_kv_cache_buffers_get_huge_pages() -> None:
    """``KVCache(huge_pages=True)`` asks its CPU buffers onto 2 MiB pages before zeroing them (a
    child process: a fresh heap, whatever the tests before left in this one)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _KV_ON_HUGE_PAGES], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # Nearly all of each 40 MiB buffer (a busy host may be short of a few free huge pages).
    assert all(int(n) >= 16 * HUGE_PAGE for n in proc.stdout.split()), proc.stdout


def test_kv_cache_on_huge_pages_stores_releases_and_resumes() -> None:
    """The buffers stay ordinary storages: zero at first, written by ``store``, and the cpu memory
    saver can still release them (resize to 0) and bring them back zeroed."""
    from framework.memory.kv_cache import KVCache
    from plugins.memory_savers.cpu import CpuMemorySaver

    cache = KVCache(num_layers=2, num_pages=4096, page_size=1, num_kv_heads=4, head_dim=64, dtype=torch.float32,
                    device="cpu", huge_pages=True)
    buffers = cache.k_buffers + cache.v_buffers
    assert all(torch.count_nonzero(b) == 0 for b in buffers)
    loc = torch.tensor([5, 4000])
    k = torch.randn(2, 4, 64)
    cache.store(1, loc, k, k + 1)
    assert torch.equal(cache.get_kv(1)[0][loc], k) and torch.equal(cache.get_kv(1)[1][loc], k + 1)
    saver = CpuMemorySaver()
    saver.track("kv_cache", buffers, keep_contents=False)
    saver.pause("kv_cache")
    assert all(b.untyped_storage().nbytes() == 0 for b in buffers)
    saver.resume("kv_cache")
    assert all(b.untyped_storage().nbytes() == 4097 * 4 * 64 * 4 and torch.count_nonzero(b) == 0 for b in buffers)
