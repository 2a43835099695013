"""Token-history penalties, batched: repetition, frequency, presence, and min_new_tokens masking.

These are the only sampling steps that depend on which tokens a request has already seen, so they
keep per-row ``[batch, vocab]`` state on the device. :class:`PenaltyState` can be built from the
full token lists (:meth:`PenaltyState.build`) or kept up to date step by step
(:meth:`PenaltyState.advance`, :meth:`PenaltyState.filter`, :meth:`PenaltyState.merge`), which
avoids re-sending every prompt to the device on each decode step.

Each part exists only if some row of the batch needs it, so a batch without penalties pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from framework.sampling.params import SamplingParams


@dataclass
class RepetitionState:
    """HF/CTRL repetition penalty over prompt and output tokens."""

    penalties: torch.Tensor
    """[bs, 1] float32; 1.0 for rows without a penalty (x*1 and x/1 are exact, so no row mask)."""
    seen: torch.Tensor
    """[bs, V] bool: the token occurs in the prompt or the output (only filled for penalised rows)."""


@dataclass
class FrequencyPresenceState:
    """OpenAI frequency and presence penalties over output tokens."""

    frequency: torch.Tensor
    """[bs, 1] float32."""
    presence: torch.Tensor
    """[bs, 1] float32."""
    counts: torch.Tensor
    """[bs, V] float32 occurrences in the output (float so the penalty is one fused multiply;
    exact up to 2**24 occurrences)."""


@dataclass
class MinTokensState:
    """Masks EOS and stop token ids while a row has produced fewer than min_new_tokens tokens."""

    token_ids: torch.Tensor
    """[bs, M] int64 ids to mask per row. Short rows repeat their first id, so duplicate scatter
    targets always carry the same value; rows with nothing to mask hold 0 and ``left`` 0."""
    left: torch.Tensor
    """[bs] int64 tokens still to generate before EOS is allowed (<= 0: no masking)."""
    max_left: int
    """CPU copy of ``left.max()``, so the state can be dropped without a device sync."""


@dataclass(eq=False)  # tensors inside: identity, not elementwise ==
class PenaltyState:
    """All history-dependent logit adjustments of one batch; parts are None when unused."""

    batch_size: int
    vocab_size: int
    device: torch.device
    repetition: RepetitionState | None = None
    freq_presence: FrequencyPresenceState | None = None
    min_tokens: MinTokensState | None = None

    @property
    def is_empty(self) -> bool:
        return self.repetition is None and self.freq_presence is None and self.min_tokens is None

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        eos_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
    ) -> PenaltyState:
        """Build from complete token histories. Cost: O(total tokens of the penalised rows)."""
        bs = len(params)
        state = cls(bs, vocab_size, device)
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep_rows:
            seen = torch.zeros(bs, vocab_size, dtype=torch.bool, device=device)
            rows, ids = _flatten(rep_rows, [prompt_ids[i] + output_ids[i] for i in rep_rows], device)
            seen[rows, ids] = True
            pen = _column([p.repetition_penalty for p in params], device)
            state.repetition = RepetitionState(pen, seen)

        fp_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0 or p.presence_penalty != 0]
        if fp_rows:
            counts = torch.zeros(bs, vocab_size, dtype=torch.float32, device=device)
            rows, ids = _flatten(fp_rows, [output_ids[i] for i in fp_rows], device)
            counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
            freq = _column([p.frequency_penalty for p in params], device)
            pres = _column([p.presence_penalty for p in params], device)
            state.freq_presence = FrequencyPresenceState(freq, pres, counts)

        per_row: list[list[int]] = []
        left: list[int] = []
        for p, out, eos in zip(params, output_ids, eos_token_ids, strict=True):
            ids = [t for t in dict.fromkeys([*eos, *p.stop_token_ids]) if 0 <= t < vocab_size]
            remaining = p.min_new_tokens - len(out)
            per_row.append(ids)
            left.append(remaining if remaining > 0 and ids else 0)
        if max(left, default=0) > 0:
            state.min_tokens = _min_tokens_state(per_row, left, device)
        return state

    # ----------------------------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Return penalised logits as a new tensor; ``logits`` itself is never modified."""
        out = logits
        if self.repetition is not None:
            rep = self.repetition
            # HF semantics: a penalty > 1 always moves the logit towards -inf.
            penalised = torch.where(out < 0, out * rep.penalties, out / rep.penalties)
            out = torch.where(rep.seen, penalised, out)
        if self.freq_presence is not None:
            fp = self.freq_presence
            out = out - (fp.frequency * fp.counts + fp.presence * (fp.counts > 0).to(out.dtype))
        if self.min_tokens is not None:
            mt = self.min_tokens
            if out is logits:
                out = logits.clone()
            # A gather/where/scatter instead of boolean indexing keeps this free of device syncs.
            current = out.gather(1, mt.token_ids)
            active = (mt.left > 0).unsqueeze(1)
            out.scatter_(1, mt.token_ids, torch.where(active, float("-inf"), current))
        return out

    def prune(self, params: list[SamplingParams], output_lens: list[int]) -> PenaltyState | None:
        """Drop the parts no row needs any more (e.g. after :meth:`filter` removed the rows that
        used them), so later steps skip their work; None when nothing is left."""
        if self.repetition is not None and all(p.repetition_penalty == 1.0 for p in params):
            self.repetition = None
        if self.freq_presence is not None and all(p.frequency_penalty == 0 and p.presence_penalty == 0 for p in params):
            self.freq_presence = None
        if self.min_tokens is not None and all(p.min_new_tokens <= n for p, n in zip(params, output_lens, strict=True)):
            self.min_tokens = None
        return None if self.is_empty else self

    # ----------------------------------------------------------------------------------------------
    def advance(self, next_token_ids: torch.Tensor) -> None:
        """Account for one newly generated token per row (``next_token_ids``: [bs] int64)."""
        ids = next_token_ids.view(-1, 1).to(self.device)
        if self.repetition is not None:
            self.repetition.seen.scatter_(1, ids, True)
        if self.freq_presence is not None:
            counts = self.freq_presence.counts
            counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
        if self.min_tokens is not None:
            self.min_tokens.left -= 1
            self.min_tokens.max_left -= 1
            if self.min_tokens.max_left <= 0:
                self.min_tokens = None

    def filter(self, keep: torch.Tensor) -> PenaltyState:
        """Rows ``keep`` ([k] int64 on the state's device), in that order."""
        rep = fp = mt = None
        if self.repetition is not None:
            r = self.repetition
            rep = RepetitionState(r.penalties[keep], r.seen[keep])
        if self.freq_presence is not None:
            f = self.freq_presence
            fp = FrequencyPresenceState(f.frequency[keep], f.presence[keep], f.counts[keep])
        if self.min_tokens is not None:
            m = self.min_tokens
            mt = MinTokensState(m.token_ids[keep], m.left[keep], m.max_left)
        return replace(self, batch_size=int(keep.numel()), repetition=rep, freq_presence=fp, min_tokens=mt)

    def merge(self, other: PenaltyState) -> PenaltyState:
        """Rows of ``self`` followed by rows of ``other``; a part missing on one side is neutral."""
        a, b = self, other
        rep = fp = mt = None
        if a.repetition is not None or b.repetition is not None:
            ra, rb = a._repetition_or_neutral(), b._repetition_or_neutral()
            rep = RepetitionState(torch.cat([ra.penalties, rb.penalties]), torch.cat([ra.seen, rb.seen]))
        if a.freq_presence is not None or b.freq_presence is not None:
            fa, fb = a._freq_presence_or_neutral(), b._freq_presence_or_neutral()
            fp = FrequencyPresenceState(
                torch.cat([fa.frequency, fb.frequency]),
                torch.cat([fa.presence, fb.presence]),
                torch.cat([fa.counts, fb.counts]),
            )
        if a.min_tokens is not None or b.min_tokens is not None:
            ma, mb = a._min_tokens_or_neutral(), b._min_tokens_or_neutral()
            width = max(ma.token_ids.shape[1], mb.token_ids.shape[1])
            mt = MinTokensState(
                torch.cat([_pad_repeat_first(ma.token_ids, width), _pad_repeat_first(mb.token_ids, width)]),
                torch.cat([ma.left, mb.left]),
                max(ma.max_left, mb.max_left),
            )
        return replace(self, batch_size=a.batch_size + b.batch_size, repetition=rep, freq_presence=fp, min_tokens=mt)

    # Neutral parts let a batch with penalties merge with one without them.
    def _repetition_or_neutral(self) -> RepetitionState:
        if self.repetition is not None:
            return self.repetition
        bs, v, dev = self.batch_size, self.vocab_size, self.device
        return RepetitionState(torch.ones(bs, 1, device=dev), torch.zeros(bs, v, dtype=torch.bool, device=dev))

    def _freq_presence_or_neutral(self) -> FrequencyPresenceState:
        if self.freq_presence is not None:
            return self.freq_presence
        bs, v, dev = self.batch_size, self.vocab_size, self.device
        zeros = torch.zeros(bs, 1, device=dev)
        return FrequencyPresenceState(zeros, zeros.clone(), torch.zeros(bs, v, device=dev))

    def _min_tokens_or_neutral(self) -> MinTokensState:
        if self.min_tokens is not None:
            return self.min_tokens
        bs, dev = self.batch_size, self.device
        return MinTokensState(
            torch.zeros(bs, 1, dtype=torch.long, device=dev),
            torch.zeros(bs, dtype=torch.long, device=dev),
            0,
        )


# --------------------------------------------------------------------------------------------------
def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(-1, 1).to(device)


def _flatten(rows: list[int], id_lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs for ``index_put_``, built on the CPU and sent in one copy each."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.long)
    row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)
    flat = torch.tensor([t for ids in id_lists for t in ids], dtype=torch.long)
    return row_idx.to(device), flat.to(device)


def _min_tokens_state(per_row: list[list[int]], left: list[int], device: torch.device) -> MinTokensState:
    width = max(1, max(len(ids) for ids in per_row))
    padded = [(ids + [ids[0]] * (width - len(ids))) if ids else [0] * width for ids in per_row]
    return MinTokensState(
        torch.tensor(padded, dtype=torch.long).to(device),
        torch.tensor(left, dtype=torch.long).to(device),
        max(left),
    )


def _pad_repeat_first(ids: torch.Tensor, width: int) -> torch.Tensor:
    if ids.shape[1] == width:
        return ids
    return torch.cat([ids, ids[:, :1].expand(-1, width - ids.shape[1])], dim=1)
