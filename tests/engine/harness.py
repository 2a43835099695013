"""A tiny stand-in for the model runner and scheduler, for testing models and attention backends.

It owns a :class:`KVCache`, a plain ``int32`` request table and a page allocator, builds
:class:`ForwardBatch` objects by hand, and runs greedy generation with optional chunked prefill
and a shared cached prefix. It is deliberately naive (no freeing, no scheduling policy): the real
scheduler is elsewhere and tested on its own.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from framework.executor.forward_batch import ForwardBatch, ForwardMode
from framework.memory.kv_cache import KVCache


class PageAllocator:
    """Gives each request whole pages, picked in random order so slots are never simply contiguous."""

    def __init__(self, num_pages: int, page_size: int, seed: int = 0) -> None:
        self.page_size = page_size
        self.free = list(range(1, num_pages + 1))  # page 0 is the cache's padding page
        random.Random(seed).shuffle(self.free)
        self.pages: dict[int, list[int]] = {}

    def slots(self, row: int, start: int, end: int) -> list[int]:
        """Slots for positions ``start .. end - 1`` of request ``row``, allocating pages as needed."""
        pages = self.pages.setdefault(row, [])
        while len(pages) * self.page_size < end:
            pages.append(self.free.pop())
        return [pages[p // self.page_size] * self.page_size + p % self.page_size for p in range(start, end)]

    def share(self, src: int, dst: int, num_tokens: int) -> None:
        """Let ``dst`` start with the first ``num_tokens`` (page-aligned) slots of ``src``."""
        assert num_tokens % self.page_size == 0, "a shared prefix must be whole pages"
        self.pages[dst] = list(self.pages[src][: num_tokens // self.page_size])


class MiniRunner:
    """KV cache + request table + ForwardBatch construction (+ a model, for :meth:`generate`)."""

    def __init__(
        self,
        backend_factory: Callable[[Any, Any], Any],
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        model: nn.Module | None = None,
        backend_options: Any = None,
        dtype: torch.dtype = torch.float32,
        page_size: int = 1,
        num_pages: int = 512,
        max_requests: int = 16,
        max_context: int = 512,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = model
        self.page_size = page_size
        self.kv_cache = KVCache(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device)
        # Stale garbage (valid slot numbers of other tokens) outside every request's live range, as a
        # reused pool row would hold: a backend that reads past seq_len gets wrong answers, not zeros.
        gen = torch.Generator().manual_seed(seed)
        self.req_to_token = torch.randint(
            0, self.kv_cache.num_slots, (max_requests, max_context), generator=gen, dtype=torch.int32
        ).to(self.device)
        self.allocator = PageAllocator(num_pages, page_size, seed)
        self.lens: dict[int, int] = {}
        self.attn_backend = backend_factory(
            SimpleNamespace(device=self.device, dtype=dtype, kv_cache=self.kv_cache, req_to_token=self.req_to_token),
            backend_options,
        )

    def new_request(self, share_from: int | None = None, shared_len: int = 0) -> int:
        """A fresh request row, optionally starting with ``shared_len`` cached tokens of another row."""
        row = len(self.lens)
        self.lens[row] = 0
        if share_from is not None and shared_len:
            self.allocator.share(share_from, row, shared_len)
            self.req_to_token[row, :shared_len] = self.req_to_token[share_from, :shared_len]
            self.lens[row] = shared_len
        return row

    def _tensor(self, values: Sequence[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(list(values), dtype=dtype, device=self.device)

    def extend_batch(self, rows: Sequence[int], new_tokens: Sequence[Sequence[int]]) -> ForwardBatch:
        """An EXTEND batch appending ``new_tokens[i]`` to request ``rows[i]`` on top of its cached tokens."""
        prefix_lens = [self.lens[r] for r in rows]
        ext_lens = [len(t) for t in new_tokens]
        positions, out_loc = [], []
        for row, p, n in zip(rows, prefix_lens, ext_lens, strict=True):
            slots = self.allocator.slots(row, p, p + n)
            self.req_to_token[row, p : p + n] = self._tensor(slots, torch.int32)
            positions.extend(range(p, p + n))
            out_loc.extend(slots)
            self.lens[row] = p + n
        starts = [sum(ext_lens[:i]) for i in range(len(rows))]
        seq_lens = [p + n for p, n in zip(prefix_lens, ext_lens, strict=True)]
        fb = ForwardBatch(
            mode=ForwardMode.EXTEND,
            batch_size=len(rows),
            input_ids=self._tensor([t for toks in new_tokens for t in toks]),
            positions=self._tensor(positions),
            req_pool_indices=self._tensor(rows),
            seq_lens=self._tensor(seq_lens),
            seq_lens_cpu=seq_lens,
            out_cache_loc=self._tensor(out_loc),
            req_to_token=self.req_to_token,
            kv_cache=self.kv_cache,
            attn_backend=self.attn_backend,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=ext_lens,
            logits_indices=self._tensor([s + n - 1 for s, n in zip(starts, ext_lens, strict=True)]),
        )
        self.attn_backend.init_forward_metadata(fb)
        return fb

    def decode_batch(self, rows: Sequence[int], tokens: Sequence[int]) -> ForwardBatch:
        """A DECODE batch: one new token per request, written to the request table before the forward."""
        out_loc, positions = [], []
        for row in rows:
            pos = self.lens[row]
            (slot,) = self.allocator.slots(row, pos, pos + 1)
            self.req_to_token[row, pos] = slot
            out_loc.append(slot)
            positions.append(pos)
            self.lens[row] = pos + 1
        seq_lens = [self.lens[r] for r in rows]
        fb = ForwardBatch(
            mode=ForwardMode.DECODE,
            batch_size=len(rows),
            input_ids=self._tensor(tokens),
            positions=self._tensor(positions),
            req_pool_indices=self._tensor(rows),
            seq_lens=self._tensor(seq_lens),
            seq_lens_cpu=seq_lens,
            out_cache_loc=self._tensor(out_loc),
            req_to_token=self.req_to_token,
            kv_cache=self.kv_cache,
            attn_backend=self.attn_backend,
            logits_indices=self._tensor(range(len(rows))),
        )
        self.attn_backend.init_forward_metadata(fb)
        return fb

    @torch.inference_mode()
    def logits(self, fb: ForwardBatch, all_tokens: bool = False) -> torch.Tensor:
        """Run the model; logits of every new token (``all_tokens``) or of each request's last one."""
        assert self.model is not None
        if all_tokens:
            fb.logits_indices = None  # every row; a model that selects rows then returns them all
        hidden = self.model(fb.input_ids, fb.positions, fb)
        if fb.logits_indices is not None and not getattr(self.model, "selects_logits_rows", False):
            hidden = hidden[fb.logits_indices]
        return self.model.compute_logits(hidden)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        chunk_size: int | None = None,
        shared_prefix_len: int = 0,
    ) -> list[list[int]]:
        """Greedy generation for all prompts as one batch.

        ``chunk_size`` splits each prompt's prefill into extends of at most that many tokens.
        ``shared_prefix_len`` prefills the first that many tokens of ``prompts[0]`` once in a donor
        request, and every prompt starting with the same tokens reuses those cached slots.
        """
        rows = []
        donor, prefix = None, []
        if shared_prefix_len:
            prefix = list(prompts[0][:shared_prefix_len])
            donor = self.new_request()
            self.logits(self.extend_batch([donor], [prefix]))
        for prompt in prompts:
            assert len(prompt) > shared_prefix_len, "each prompt needs a token beyond the shared prefix"
            shares = donor is not None and list(prompt[:shared_prefix_len]) == prefix
            rows.append(self.new_request(donor if shares else None, shared_prefix_len if shares else 0))
        # Prefill in rounds; a request's first token comes from the round that ends its prompt.
        next_tokens: dict[int, int] = {}
        while len(next_tokens) < len(rows):
            batch_rows, batch_tokens = [], []
            for row, prompt in zip(rows, prompts, strict=True):
                done = self.lens[row]
                if done < len(prompt):
                    end = len(prompt) if chunk_size is None else min(len(prompt), done + chunk_size)
                    batch_rows.append(row)
                    batch_tokens.append(list(prompt[done:end]))
            logits = self.logits(self.extend_batch(batch_rows, batch_tokens))
            for i, row in enumerate(batch_rows):
                if self.lens[row] == len(prompts[rows.index(row)]):
                    next_tokens[row] = int(logits[i].argmax())
        outputs = [[next_tokens[r]] for r in rows]
        for _ in range(max_new_tokens - 1):
            logits = self.logits(self.decode_batch(rows, [out[-1] for out in outputs]))
            for out, tok in zip(outputs, logits.argmax(-1).tolist(), strict=True):
                out.append(int(tok))
        return outputs
