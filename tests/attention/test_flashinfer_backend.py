"""The ``flashinfer`` backend: CUDA only. On CPU, selecting it fails at start naming the reason; on a
GPU (tests marked ``gpu``) it passes the conformance kit in fp16 and bf16 (flashinfer has no fp32)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from framework.errors import ConfigError
from framework.testing.attention_conformance import assert_conformant, conformance_cases
from plugins.attention.flashinfer import FlashInferAttnBackend, FlashInferOptions


def test_registered_through_the_entry_point(plugins) -> None:
    comp = plugins.registry.get("attention_backend", "flashinfer")
    assert comp.factory is FlashInferAttnBackend and comp.options_cls is FlashInferOptions
    assert plugins.infos["flashinfer"].builtin


def test_cpu_device_fails_with_the_reason() -> None:
    with pytest.raises(
        ConfigError, match="attention.backend=flashinfer runs only on CUDA GPUs, but the device is 'cpu'"
    ):
        FlashInferAttnBackend(SimpleNamespace(device="cpu"), None)


@pytest.mark.timeout(120)
def test_selecting_it_on_cpu_fails_before_loading_anything(tmp_path) -> None:
    """Its declared devices (cuda) are checked when the config is resolved."""
    from framework import Engine
    from framework.testing.tiny_models import save_tiny_model

    path = save_tiny_model(tmp_path / "llama", "LlamaForCausalLM")
    with pytest.raises(ConfigError, match=r"attention\.backend: .*'flashinfer' runs on cuda, not on cpu.*torch_native"):
        Engine(
            overrides=[
                f"model.path={path}",
                "device.device=cpu",
                "attention.backend=flashinfer",
                "kv_cache.max_total_tokens=256",
            ],
            progress=False,
        )


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_conformance_on_gpu() -> None:
    pytest.importorskip(
        "flashinfer", reason="the flashinfer package is not installed (pip install 'plugserve[flashinfer]')"
    )
    dtypes = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else [])
    print(assert_conformant("flashinfer", device="cuda", cases=conformance_cases("cuda", dtypes=dtypes)))


def test_unavailable_reason_names_what_is_missing() -> None:
    reason = FlashInferAttnBackend.unavailable_reason()
    if not torch.cuda.is_available():
        assert reason == "no CUDA device"


@pytest.mark.gpu
def test_fp32_is_refused_with_the_reason() -> None:
    pytest.importorskip(
        "flashinfer", reason="the flashinfer package is not installed (pip install 'plugserve[flashinfer]')"
    )
    from framework.testing.attention_conformance import ConformanceCase, check_case

    result = check_case("flashinfer", ConformanceCase("extend", 16, 8, 2, 64, torch.float32), device="cuda")
    assert result.error is not None and "computes in float16/bfloat16" in result.error


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_table_names_exactly_each_requests_slots(page_size: int) -> None:
    """The CSR page table handed to flashinfer, expanded back to slots, is each request's
    ``req_to_token`` row up to its length (checked on CPU; the kernels themselves need a GPU)."""
    from plugins.attention.flashinfer.backend import paged_kv_csr

    gen = torch.Generator().manual_seed(0)
    num_pages, rows, width = 64, 4, 80
    # Stale slot numbers everywhere, then shuffled whole pages for each request's live range.
    table = torch.randint(0, (num_pages + 1) * page_size, (rows, width), generator=gen, dtype=torch.int32)
    free = (torch.randperm(num_pages, generator=gen) + 1).tolist()
    seq_lens = [1, page_size, 2 * page_size + 1, 37]
    for row, n in enumerate(seq_lens):
        pages = [free.pop() for _ in range(-(-n // page_size))]
        table[row, :n] = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)])
    order = torch.tensor([2, 0, 3, 1])  # batch order differs from pool-row order
    lens = torch.tensor(seq_lens)[order]
    indptr, indices, last = paged_kv_csr(table, order, lens, max(seq_lens), page_size)
    for i, row in enumerate(order.tolist()):
        pages = indices[indptr[i] : indptr[i + 1]].tolist()
        n = seq_lens[row]
        assert 1 <= int(last[i]) <= page_size
        assert (len(pages) - 1) * page_size + int(last[i]) == n
        slots = [pg * page_size + off for pg in pages for off in range(page_size)][:n]
        assert slots == table[row, :n].tolist()
