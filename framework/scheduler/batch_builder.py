"""Turn a list of scheduled requests into a ForwardBatch, and say which logits rows mean what."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from framework.executor.forward_batch import ForwardBatch, ForwardMode
from framework.multimodal.inputs import is_pad_id
from framework.multimodal.mrope import chunk_positions
from framework.scheduler.request import Req


@dataclass
class LogitsPlan:
    """Which rows of the computed logits serve sampling and which serve prompt logprobs."""

    sample_reqs: list[Req] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    """Row (in the logits tensor) of each sampling request's last token."""
    prompt_rows: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """rid -> (first logits row, number of rows, prompt position of the first row)."""


def build_extend(
    reqs: list[Req], out_cache_loc: torch.Tensor, runner: object
) -> tuple[ForwardBatch, LogitsPlan]:
    """A prefill (extend) batch: each request computes ``extend_len`` tokens after ``kv_len``."""
    device = runner.device  # type: ignore[attr-defined]
    ids: list[int] = []
    positions: list[int] = []
    logits_tokens: list[int] = []
    mrope = bool(getattr(runner, "uses_mrope", False))
    mrope_rows: list[torch.Tensor] = []
    plan = LogitsPlan()
    offset = 0
    for r in reqs:
        start, end = r.kv_len, r.kv_len + r.extend_len
        ids.extend(r.fill_ids[start:end])
        if mrope:
            mrope_rows.append(chunk_positions(r.mm_inputs, start, end, len(r.input_ids)))
        else:
            positions.extend(range(start, end))
        if r.wants_prompt_logprobs() and not r.prompt_logprobs_done():
            # logits at position p give the logprob of prompt token p + 1
            first = max(start, max(r.logprob_start_len, 1) - 1)
            last = min(end, len(r.input_ids) - 1)
            if last > first:
                plan.prompt_rows[r.rid] = (len(logits_tokens), last - first, first)
                logits_tokens.extend(range(offset + first - start, offset + last - start))
        if end == r.seq_len:  # prefill complete: this request samples its next token
            plan.sample_reqs.append(r)
            plan.sample_rows.append(len(logits_tokens))
            logits_tokens.append(offset + r.extend_len - 1)
        offset += r.extend_len
    extend_lens = [r.extend_len for r in reqs]
    prefix_lens = [r.kv_len for r in reqs]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        batch_size=len(reqs),
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=(torch.cat(mrope_rows, dim=1).to(device) if mrope
                   else torch.tensor(positions, dtype=torch.int64, device=device)),
        req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        seq_lens_cpu=seq_lens,
        out_cache_loc=out_cache_loc,
        req_to_token=runner.req_to_token,  # type: ignore[attr-defined]
        kv_cache=runner.kv_cache,  # type: ignore[attr-defined]
        attn_backend=runner.attn_backend,  # type: ignore[attr-defined]
        mm_inputs=[r.mm_inputs for r in reqs] if any(r.mm_inputs is not None for r in reqs) else None,
        extend_prefix_lens_cpu=prefix_lens,
        extend_seq_lens_cpu=extend_lens,
        logits_indices=torch.tensor(logits_tokens, dtype=torch.int64, device=device),
    )
    return batch, plan


def build_decode(
    reqs: list[Req], out_cache_loc: torch.Tensor, runner: object, pending_input: list[bool] | None = None
) -> ForwardBatch:
    """A decode batch: each request feeds its last sampled token at position ``kv_len``.

    ``pending_input[i]``: that token is still being sampled by the in-flight step (overlap mode);
    a placeholder goes in and the worker fills it in.
    """
    device = runner.device  # type: ignore[attr-defined]
    seq_lens = [r.kv_len + 1 for r in reqs]
    pending = pending_input or [False] * len(reqs)
    ids = [0 if p else r.output_ids[-1] for r, p in zip(reqs, pending, strict=True)]
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        batch_size=len(reqs),
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=_decode_positions(reqs, bool(getattr(runner, "uses_mrope", False)), device),
        req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        seq_lens_cpu=seq_lens,
        out_cache_loc=out_cache_loc,
        req_to_token=runner.req_to_token,  # type: ignore[attr-defined]
        kv_cache=runner.kv_cache,  # type: ignore[attr-defined]
        attn_backend=runner.attn_backend,  # type: ignore[attr-defined]
        logits_indices=None,
    )


def _decode_positions(reqs: list[Req], mrope: bool, device: torch.device) -> torch.Tensor:
    """Each request's next position ``kv_len``; with M-RoPE ``kv_len + delta`` on all three rows."""
    if not mrope:
        return torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=device)
    pos = [r.kv_len + (r.mm_inputs.mrope_position_delta if r.mm_inputs is not None else 0) for r in reqs]
    return torch.tensor(pos, dtype=torch.int64, device=device).expand(3, len(reqs)).contiguous()


def record_prompt_logprobs(reqs: list[Req], logits: torch.Tensor, plan: LogitsPlan) -> None:
    """Append each request's prompt logprobs (and top logprobs) from its rows of ``logits``."""
    if not plan.prompt_rows:
        return
    by_rid = {r.rid: r for r in reqs}
    for rid, (row, n, first_pos) in plan.prompt_rows.items():
        r = by_rid[rid]
        logp = torch.log_softmax(logits[row : row + n], dim=-1)
        target_ids = r.input_ids[first_pos + 1 : first_pos + 1 + n]
        # An image token (pad id) is no vocabulary entry: its position reports None everywhere.
        pads = [is_pad_id(t) for t in target_ids] if r.mm_inputs is not None else [False] * n
        targets = torch.tensor([0 if p else t for t, p in zip(target_ids, pads, strict=True)], device=logp.device)
        values = logp.gather(1, targets[:, None]).squeeze(1).tolist()
        r.input_logprobs.extend(None if p else v for v, p in zip(values, pads, strict=True))
        if r.top_logprobs_num:
            vals, ids = logp.topk(r.top_logprobs_num, dim=-1)
            r.input_top_logprobs.extend(
                None if p else list(zip(i, v, strict=True))
                for i, v, p in zip(ids.tolist(), vals.tolist(), pads, strict=True)
            )
        if r.token_ids_logprob:
            watched = r.token_ids_logprob
            rows = logp[:, torch.tensor(watched, device=logp.device)].tolist()
            r.input_token_ids_logprobs.extend(
                None if p else list(zip(watched, row, strict=True)) for row, p in zip(rows, pads, strict=True)
            )
