"""ModelRunner: loads the model plugin, sizes and builds KV memory, runs forwards.

KV memory has two levels, as in SGLang: the request pool (a plugin: ``req_to_token`` rows) and a
page allocator over per-layer K/V buffers. Capacity comes from a configured budget on CPU, or from
the device memory really free after loading the weights on GPU, never from a constant.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from framework.config.loader import validate_options
from framework.config.schema import PlugserveConfig
from framework.distributed.state import get_tensor_parallel, kv_heads_per_rank
from framework.errors import ConfigError
from framework.executor.cuda_graph_runner import CudaGraphRunner, maybe_create_cuda_graph_runner
from framework.executor.forward_batch import ForwardBatch
from framework.executor.weights import ModelWeights
from framework.kernels.huge_pages import huge_pages_available
from framework.kernels.panel_gemm import kernel_available as panel_gemm_available
from framework.kernels.small_gemm import kernel_available as small_gemm_available
from framework.memory.heap import keep_freed_blocks, on_for_own_process, trim_heap
from framework.memory.kv_allocator import PagedKVAllocator
from framework.memory.kv_cache import KVCache
from framework.memory.memory_saver import MEMORY_TAGS, MemorySaver, available_memory_bytes
from framework.models.cpu_linear import (
    onednn_linear_available,
    pack_linear_layers,
    packable_dtypes,
    small_gemm_extra_bytes,
)
from framework.models.fused_decode import enable_fused_decode
from framework.models.gemm_warmup import GemmWarmup, warm_packed_gemms
from framework.models.loader import build_model, config_dtype, load_hf_config, resolve_dtype
from framework.plugins import get_registry

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass
class MemoryPlan:
    """KV sizing derived at start (all in tokens, page-aligned)."""

    num_pages: int
    page_size: int
    max_running_requests: int
    context_len: int
    """Longest request (prompt + output) the server admits."""

    @property
    def total_tokens(self) -> int:
        return self.num_pages * self.page_size


class ModelRunner:
    """Owns the model, the KV cache, the request pool and the attention backend."""

    def __init__(self, settings: PlugserveConfig, progress: bool = True) -> None:
        self.settings = settings
        self.released_tags: set[str] = set()
        self.weight_version = "default"
        """What the trainer called the weights now served (``weight_version`` of an update)."""
        self.device = torch.device(settings.device.device.value)
        if self.device.type == "cpu" and settings.device.num_threads:
            torch.set_num_threads(settings.device.num_threads)
        torch.manual_seed(settings.device.seed)
        registry = get_registry()

        path = os.fspath(settings.model.path)
        self.model_path = path
        self.hf_config = load_hf_config(path)
        arch = settings.model.architecture or (getattr(self.hf_config, "architectures", None) or ["?"])[0]
        model_comp = registry.get("model", arch, key="model.architecture")
        model_options = model_comp.make_options(
            validate_options(model_comp, settings.model.options, "model.options")
        )
        self.architecture = arch
        self.dtype = resolve_dtype(config_dtype(self.hf_config), settings.model.dtype.value, self.device)
        saver_comp = registry.get("memory_saver", settings.memory_saver.name, key="memory_saver.name")
        self.memory_saver: MemorySaver = saver_comp.factory(saver_comp.make_options(settings.memory_saver.options))
        with self.memory_saver.region("weights"):
            self.model = build_model(
                self.hf_config, model_comp.factory, model_options, self.dtype, self.device, path, progress
            )
        # A vision-language config nests the language model's sizes in its text config.
        self.text_config = self.hf_config.get_text_config()
        self.vocab_size = int(self.text_config.vocab_size)
        self.uses_mrope = bool(getattr(self.model, "uses_mrope", False))
        """The model takes ``[3, num_tokens]`` M-RoPE positions (Qwen2-VL family)."""
        self.linear_impl = self._pack_cpu_linears(settings.device.cpu_linear.value)
        # Decoder stacks that can run a decode step's layers in one C call (they check per step).
        self.fused_decode = bool(self.small_gemm and settings.device.cpu_fused_decode
                                 and enable_fused_decode(self.model))
        self.weights = ModelWeights(self.model, model_comp.factory, model_options, self.hf_config, self.dtype,
                                    packed=self.linear_impl == "onednn", saver=self.memory_saver,
                                    small_gemm=self.small_gemm, huge_pages=settings.device.cpu_huge_pages,
                                    prefill_gemm=self.prefill_gemm)

        # This rank's KV heads: a tensor-parallel rank caches only the heads its attention computes.
        self.tp = get_tensor_parallel()
        total_kv = getattr(self.text_config, "num_key_value_heads", None) or self.text_config.num_attention_heads
        self.kv_heads = kv_heads_per_rank(total_kv, self.tp.size)
        self.plan = self._plan_memory()
        kv_dtype = self.dtype if settings.kv_cache.dtype.value == "auto" else getattr(
            torch, settings.kv_cache.dtype.value
        )
        text_cfg = self.text_config
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
        # The KV cache and the request pool are released together (SGLang allocates its request
        # pools in the same saver region).
        with self.memory_saver.region("kv_cache"):
            self.kv_cache = KVCache(
                num_layers=text_cfg.num_hidden_layers,
                num_pages=self.plan.num_pages,
                page_size=self.plan.page_size,
                num_kv_heads=self.kv_heads,
                head_dim=head_dim,
                dtype=kv_dtype,
                device=self.device,
                huge_pages=settings.device.cpu_huge_pages,
            )
            self.allocator = PagedKVAllocator(self.plan.num_pages, self.plan.page_size, self.device)

            pool_comp = registry.get("memory_pool", settings.memory_pool.name, key="memory_pool.name")
            self.req_pool = pool_comp.factory(
                self.plan.max_running_requests,
                self.plan.context_len + self.plan.page_size,
                self.device,
                pool_comp.make_options(settings.memory_pool.options),
            )
            self.req_to_token = self.req_pool.req_to_token
        self.memory_saver.track("kv_cache", [*self.kv_cache.k_buffers, *self.kv_cache.v_buffers], keep_contents=False)

        attn_comp = registry.get("attention_backend", settings.attention.backend, key="attention.backend")
        self.attn_backend = attn_comp.factory(self, attn_comp.make_options(settings.attention.options))
        logger.info(
            "KV cache: %d tokens in %d pages of %d; max running requests %d; context length %d",
            self.plan.total_tokens, self.plan.num_pages, self.plan.page_size,
            self.plan.max_running_requests, self.plan.context_len,
        )
        # Last: capture needs the model, the KV cache, the request table and the backend. None on CPU.
        with self.memory_saver.region("cuda_graph"):
            self.cuda_graph_runner: CudaGraphRunner | None = maybe_create_cuda_graph_runner(self, settings.cuda_graph)
        # After loading: the weights and the KV cache keep their own mappings, and what loading
        # freed is not held in the heap for steps that never need that much.
        wanted = self.device.type == "cpu" and on_for_own_process(settings.device.cpu_keep_freed_memory)
        self.keeps_freed_memory = wanted and keep_freed_blocks()  # keep_freed_blocks: False off glibc
        self.gemm_warmup: GemmWarmup | None = None
        """What :meth:`warm_cpu_gemms` did; None until it ran (or where it does not apply)."""

    def warm_cpu_gemms(self, max_rows: int, max_logits_rows: int) -> GemmWarmup | None:
        """Build oneDNN's primitives for every row bucket of the packed linears now, not at some
        request's step (``device.cpu_gemm_warmup``, :mod:`framework.models.gemm_warmup`): up to
        ``max_rows`` rows a step, ``max_logits_rows`` for the LM head. None where it does not apply
        (not CPU, linears not packed, switched off)."""
        if self.device.type != "cpu" or self.linear_impl != "onednn":
            return None
        if not on_for_own_process(self.settings.device.cpu_gemm_warmup):
            return None
        self.gemm_warmup = warm_packed_gemms(self.model, max_rows, max_logits_rows,
                                             self.settings.device.cpu_gemm_warmup_max_s)
        # Its freed outputs would stay in the C heap (~300 MB for llama-120m: glibc's mmap
        # threshold rises as big blocks are freed), where no step may need them; the primitives
        # themselves are ~1 MB each. A large step grows the heap again as it would have anyway.
        trim_heap()
        return self.gemm_warmup

    def _pack_cpu_linears(self, choice: str) -> str:
        """Swap linear layers for oneDNN-packed ones on CPU when chosen; return what runs."""
        self.small_gemm = False
        self.prefill_gemm = "aten"
        if self.device.type != "cpu" or choice == "aten":
            if self.settings.device.cpu_small_gemm.value == "kernel":
                raise ConfigError("device.cpu_small_gemm: kernel needs device.cpu_linear onednn (or auto) on CPU; "
                                  "allowed values: auto, kernel, onednn")
            return "aten"
        usable = onednn_linear_available() and self.dtype in packable_dtypes()
        if choice == "onednn" and not usable:
            raise ConfigError(
                "device.cpu_linear: onednn needs a float32 model (or bfloat16 on a CPU with native bf16 "
                "dot products) and a torch build with oneDNN "
                f"(model dtype {str(self.dtype).removeprefix('torch.')}, oneDNN available: "
                f"{onednn_linear_available()}); allowed values: auto, onednn, aten"
            )
        if not usable:
            if self.settings.device.cpu_small_gemm.value == "kernel":
                raise ConfigError("device.cpu_small_gemm: kernel needs device.cpu_linear onednn (or auto) with a "
                                  "float32 model (or bfloat16 on a CPU with native bf16); "
                                  "allowed values: auto, kernel, onednn")
            return "aten"
        self.small_gemm = self._choose_small_gemm(self.settings.device.cpu_small_gemm.value)
        self.prefill_gemm = self._choose_prefill_gemm(self.settings.device.cpu_prefill_gemm.value)
        pack_linear_layers(self.model, small_gemm=self.small_gemm, huge_pages=self.settings.device.cpu_huge_pages,
                           blas=self.prefill_gemm == "aten", panel=self.prefill_gemm == "kernel")
        return "onednn"

    @property
    def prefill_blas(self) -> bool:
        """Whether the packed linears keep dense copies for ``F.linear`` on large calls (aten)."""
        return self.linear_impl == "onednn" and self.prefill_gemm == "aten"

    def _choose_prefill_gemm(self, choice: str) -> str:
        """What runs the packed linears' calls past the small-GEMM kernel's rows
        (``device.cpu_prefill_gemm``): ``onednn``, ``aten`` (dense copies for ``F.linear`` from
        ``cpu_linear.BLAS_MIN_ROWS`` rows) or ``kernel`` (the panel GEMM on the small-GEMM copy)."""
        fp32 = self.dtype == torch.float32
        if choice == "kernel" and not (fp32 and self.small_gemm and panel_gemm_available()):
            raise ConfigError(
                "device.cpu_prefill_gemm: kernel needs a float32 model, the small-GEMM weight copy "
                "(device.cpu_small_gemm auto or kernel) and a C compiler with AVX2 and FMA "
                f"(model dtype {str(self.dtype).removeprefix('torch.')}, small-GEMM copy: {self.small_gemm}, "
                f"kernel available: {panel_gemm_available()}); allowed values: auto, onednn, aten, kernel")
        if choice != "auto":
            return choice
        # Measured ahead only where torch's best vector unit is AVX2 (the Zen 3 host); oneDNN's
        # AVX-512 kernels were as fast as MKL on the Zen 4 one (docs/benchmarks.md).
        if not (fp32 and torch.backends.cpu.get_cpu_capability() == "AVX2"):
            return "onednn"
        if self.small_gemm and panel_gemm_available():
            return "kernel"  # no extra copy: it reads the decode steps' one
        extra = small_gemm_extra_bytes(self.model) * (2 if self.small_gemm else 1)
        return "aten" if extra <= available_memory_bytes() // 4 else "onednn"

    def _choose_small_gemm(self, choice: str) -> bool:
        """Whether packed fp32 linears also keep a plain copy for the small-GEMM kernel."""
        if choice == "onednn":
            return False
        fits = self.dtype in (torch.float32, torch.bfloat16) and small_gemm_available()
        if choice == "kernel":
            if not fits:
                raise ConfigError(
                    "device.cpu_small_gemm: kernel needs a float32 or bfloat16 model and a C compiler for it "
                    f"(model dtype {str(self.dtype).removeprefix('torch.')}, kernel available: "
                    f"{small_gemm_available()}); allowed values: auto, kernel, onednn")
            return True
        # auto: the copy must not crowd out the KV cache or the host: a quarter of what is free.
        return fits and small_gemm_extra_bytes(self.model) <= available_memory_bytes() // 4

    # -- sizing ----------------------------------------------------------------------------

    def _plan_memory(self) -> MemoryPlan:
        s, cfg = self.settings, self.text_config
        page_size = s.kv_cache.page_size
        kv_dtype = self.dtype if s.kv_cache.dtype.value == "auto" else getattr(torch, s.kv_cache.dtype.value)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_token = KVCache.bytes_per_token_all_layers(cfg.num_hidden_layers, self.kv_heads, head_dim, kv_dtype)
        if s.kv_cache.max_total_tokens is not None:
            tokens = s.kv_cache.max_total_tokens
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            tokens = int(free * s.kv_cache.gpu_memory_fraction) // per_token
        else:
            tokens = int(s.kv_cache.cpu_memory_budget_gb * GIB) // per_token
        num_pages = tokens // page_size
        if num_pages < 2:
            raise ConfigError(
                f"kv_cache: the KV budget holds only {tokens} tokens ({per_token} bytes each); "
                "raise kv_cache.cpu_memory_budget_gb / gpu_memory_fraction or max_total_tokens"
            )
        total = num_pages * page_size
        model_ctx = int(getattr(cfg, "max_position_embeddings", 0) or total)
        context_len = s.model.context_length or model_ctx
        # One request alone must fit in the cache (with a page of slack for the partial page).
        context_len = min(context_len, total - page_size)
        if s.scheduler.max_running_requests is not None:
            max_running = s.scheduler.max_running_requests
        else:
            max_running = max(1, min(s.scheduler.max_running_requests_limit,
                                     total // s.scheduler.expected_tokens_per_request))
        return MemoryPlan(num_pages, page_size, max_running, context_len)

    # -- forward ---------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model; return float32 logits of the rows in ``batch.logits_indices``."""
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(batch):
            return self.cuda_graph_runner.replay(batch)
        self.attn_backend.init_forward_metadata(batch)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        if batch.logits_indices is not None and not getattr(self.model, "selects_logits_rows", False):
            hidden = hidden.index_select(0, batch.logits_indices)
        return self.model.compute_logits(hidden).float()

    # -- memory release (RL) ----------------------------------------------------------------

    def release_memory(self, tags: list[str]) -> None:
        """Free the memory of ``tags`` through the memory saver. The caller makes sure no request
        holds KV and the prefix cache is empty before ``kv_cache`` goes."""
        if "weights" in tags:
            self.weights.release()
        for tag in ("kv_cache", "cuda_graph"):
            if tag in tags and tag not in self.released_tags:
                self.memory_saver.pause(tag)
        self.released_tags.update(t for t in tags if t in MEMORY_TAGS)

    def resume_memory(self, tags: list[str]) -> None:
        """Bring ``tags`` back (weights with their contents, KV cache zeroed)."""
        for tag in ("cuda_graph", "kv_cache"):
            if tag in tags and tag in self.released_tags:
                self.memory_saver.resume(tag)
        if "weights" in tags:
            self.weights.resume()
        self.released_tags.difference_update(tags)

    def describe(self) -> dict[str, Any]:
        """What /model_info and /server_info report about the loaded model and memory."""
        return {
            "model_path": self.model_path,
            "architecture": self.architecture,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "vocab_size": self.vocab_size,
            "context_length": self.plan.context_len,
            "max_total_num_tokens": self.plan.total_tokens,
            "page_size": self.plan.page_size,
            "max_running_requests": self.plan.max_running_requests,
            "attention_backend": self.settings.attention.backend,
            "memory_pool": self.settings.memory_pool.name,
            "cpu_linear": self.linear_impl,
            "cpu_small_gemm": self.small_gemm,
            "cpu_prefill_gemm": self.prefill_gemm,
            "cpu_fused_decode": self.fused_decode,
            "cpu_keep_freed_memory": self.keeps_freed_memory,
            "cpu_gemm_warmup": None if self.gemm_warmup is None else asdict(self.gemm_warmup),
            "cpu_huge_pages": self.small_gemm and self.settings.device.cpu_huge_pages and huge_pages_available(),
            "memory_saver": self.memory_saver.name,
            "tp_size": self.tp.size,
            "kv_heads_per_rank": self.kv_heads,
            "cuda_graph_batch_sizes": self.cuda_graph_runner.sizes if self.cuda_graph_runner else None,
        }
