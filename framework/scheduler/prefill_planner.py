"""Choosing the next prefill batch: policy order, KV budget, token budget, chunking.

The KV budget counts what running requests may still need: each reserves its remaining
``max_new_tokens`` (clipped) times the current new-token ratio, which starts at
``scheduler.init_new_token_ratio`` and decays while decoding runs without retraction (SGLang's
scheme). A request is admitted only if its prompt plus its own reservation fits in what is left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from framework.config.schema import SchedulerConfig
from framework.scheduler.kv_manager import KVManager
from framework.scheduler.policy import SchedulePolicy
from framework.scheduler.request import Req


@dataclass
class PrefillPlan:
    """Requests to prefill now (each with ``extend_len`` set) and the chunked one, if any."""

    reqs: list[Req] = field(default_factory=list)
    chunked: Req | None = None
    """The request whose prefill continues in a later batch."""
    mixed: bool = False
    """Planned as a mixed step: the running requests' decode rows join this batch's forward."""


def reserved_decode_tokens(reqs: list[Req], ratio: float, clip: int) -> int:
    """KV the running requests are expected to still need."""
    total = 0.0
    for r in reqs:
        remaining = r.sampling_params.max_new_tokens - len(r.output_ids)
        total += min(max(remaining, 0), clip) * ratio
    return int(total)


def round_robin_by_group(ordered: list[Req]) -> list[Req]:
    """The k-th waiting request of every group before the (k+1)-th of any, keeping the policy's
    order otherwise (a stable re-order by rank within the group). A group is the HTTP request the
    scheduler requests came in (a batch, ``n`` choices); a request with no group is its own."""
    counts: dict[object, int] = {}
    ranks: list[int] = []
    for r in ordered:
        key = r.group if r.group is not None else id(r)
        ranks.append(counts.get(key, 0))
        counts[key] = ranks[-1] + 1
    if len(counts) == len(ordered):
        return ordered  # no group has two waiting requests: nothing to interleave
    order = sorted(range(len(ordered)), key=lambda i: (ranks[i], i))
    return [ordered[i] for i in order]


class PrefillPlanner:
    """Builds one prefill batch per call from the waiting queue and the chunked request."""

    def __init__(self, cfg: SchedulerConfig, kv: KVManager, policy: SchedulePolicy, max_running: int):
        self.cfg = cfg
        self.kv = kv
        self.policy = policy
        self.max_running = max_running

    def _alloc_tokens(self, extend: int) -> int:
        """KV tokens allocating ``extend`` tokens after a page-aligned (cached) prefix takes."""
        page = self.kv.page_size
        return -(-extend // page) * page

    def plan(
        self, waiting: list[Req], running: list[Req], chunked: Req | None, ratio: float, decode_rows: int = 0
    ) -> PrefillPlan:
        """``decode_rows``: the running requests' rows when this is a mixed step (0: a prefill
        alone); they take that many tokens of ``scheduler.mixed_chunk_max_tokens``."""
        cfg = self.cfg
        clip = cfg.clip_max_new_tokens_estimation
        chunk_cap = cfg.chunked_prefill_size or (1 << 62)
        budget = (cfg.mixed_chunk_max_tokens or cfg.max_prefill_tokens) if decode_rows else cfg.max_prefill_tokens
        rem_input = max(budget - decode_rows, 1)
        running_reserve = reserved_decode_tokens(running, ratio, clip)
        admitted_cost = 0
        plan = PrefillPlan(mixed=decode_rows > 0)

        if chunked is not None:
            # The request mid-prefill continues first: its row and prefix are already held.
            remaining = chunked.seq_len - chunked.kv_len
            chunked.extend_len = min(remaining, chunk_cap, max(rem_input, 1))
            if chunked.extend_len > self.kv.available_tokens() - self.kv.page_size:
                return plan  # no KV for the next chunk until decodes free some
            plan.reqs.append(chunked)
            rem_input -= chunked.extend_len
            admitted_cost += chunked.extend_len
            if chunked.extend_len < remaining:
                plan.chunked = chunked
                return plan

        slots_left = self.max_running - len(running) - len(plan.reqs)
        if slots_left <= 0 or not waiting or rem_input <= 0:
            return plan
        ordered = self.policy.order(waiting, lambda r: self.kv.match(r).prefix_len)
        if cfg.fair_admission:
            ordered = round_robin_by_group(ordered)
        head_len = cfg.in_batch_prefix_check_tokens
        batch_heads: set[tuple[int, ...]] = set()
        for req in ordered:
            if slots_left <= 0 or rem_input <= 0:
                break
            match = self.kv.match(req)
            head = tuple(req.fill_ids[:head_len]) if head_len and len(req.fill_ids) > head_len else None
            if head is not None and match.prefix_len < head_len:
                if head in batch_heads:
                    continue  # shares an uncached prefix with a request in this batch: next batch hits
                batch_heads.add(head)
            # Recomputed each time: locking an admitted request's prefix makes it unevictable.
            rem_total = self.kv.available_tokens() - running_reserve - admitted_cost
            need = req.seq_len - match.prefix_len
            reserve = min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), clip) * ratio
            # Admit when the prompt and its reservation fit; a lone request may start as long as
            # its first chunk fits (it is admitted only because its whole length fits the cache).
            extend = min(need, chunk_cap, rem_input)
            fits_whole = self._alloc_tokens(need) + reserve <= rem_total
            if not fits_whole and (plan.reqs or running or extend + self.kv.page_size > rem_total):
                break
            if extend < need and plan.reqs and extend < min(need, chunk_cap):
                break  # out of input budget: start it in a batch of its own
            if not self.kv.admit(req, match):
                break
            req.extend_len = extend
            plan.reqs.append(req)
            rem_input -= extend
            admitted_cost += self._alloc_tokens(extend) + int(reserve)
            slots_left -= 1
            if extend < need:
                plan.chunked = req
                break
        return plan
