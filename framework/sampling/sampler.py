"""Batched sampling on the device: logit bias -> logit processors -> penalties -> temperature ->
top-k -> top-p -> min-p -> sample.

The pipeline follows Hugging Face ``generate`` (and vLLM / SGLang) step for step, and the tests
check the distribution it samples from against ``transformers.generation.logits_process`` row by
row. Every step works on the whole ``[batch, vocab]`` tensor with per-row parameter tensors, and
is skipped entirely when no row of the batch needs it.

Logprobs are those of the *raw* model logits (``log_softmax`` before penalties, temperature and
filtering), which is vLLM's default and what OpenAI clients expect to compare across settings.

Drawing: greedy rows take the argmax; the others one uniform each, mapped through the row's
cumulative distribution (inverse CDF, in float64; a C kernel on CPU, :mod:`framework.kernels.sampling`).

Seeded rows: the uniform of a row with a seed is drawn from a generator seeded by
``mix(seed, number of output tokens so far)``, so its tokens do not depend on which other requests
share the batch, their order, or on retraction and re-prefill. Rows without a seed use the global
torch RNG.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from framework.kernels.sampling import argmax_rows as argmax_rows_kernel
from framework.kernels.sampling import inverse_cdf_torch, sample_from_probs
from framework.plugins import get_registry
from framework.sampling.grammar_mask import apply_token_bitmask
from framework.sampling.logit_bias import BatchLogitBias, apply_logit_bias
from framework.sampling.logit_processor import ProcessorGroup, apply_logit_processors, build_groups
from framework.sampling.params import SamplingParams
from framework.sampling.penalties import PenaltyState

_MASK64 = (1 << 64) - 1


@dataclass
class SampleOutput:
    """What one sampling step returns."""

    next_token_ids: torch.Tensor
    """[bs] int64 on the logits' device."""
    logprobs: torch.Tensor | None
    """[bs] float32 raw-logit log-softmax at the chosen tokens (before penalties/temperature);
    None when ``sample`` was called with ``return_logprobs=False``."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per row the ``top_logprobs_nums[i]`` best raw-logit tokens with their logprobs (empty list
    for rows that asked for none); None when no numbers were passed."""
    token_ids_logprobs: list[list[tuple[int, float]]] | None = None
    """Per row (token id, raw-logit logprob) of each id the row asked for (``token_ids``); None
    when none were passed."""


@dataclass(eq=False)  # tensors inside: identity, not elementwise ==
class SamplingBatchInfo:
    """Per-row sampling parameters of one batch as device tensors, plus which steps are needed.

    Build it with :meth:`build` (from full token histories) or keep one alive across decode steps
    with :meth:`advance`, :meth:`filter` and :meth:`merge`.
    """

    params: list[SamplingParams]
    vocab_size: int
    device: torch.device
    temperatures: torch.Tensor
    """[bs, 1] float32; 1.0 for greedy rows (they take argmax and never divide)."""
    top_ks: torch.Tensor
    """[bs, 1] int64 in [1, V]; V means off."""
    top_p_cutoffs: torch.Tensor
    """[bs, 1] float32 ``1 - top_p`` (computed in float64, as HF does), -1.0 when top-p is off."""
    min_ps: torch.Tensor
    """[bs, 1] float32; 0 means off."""
    greedy_mask: torch.Tensor
    """[bs] bool."""
    penalties: PenaltyState | None
    seeds: list[int | None]
    output_lens: list[int]
    """Output tokens so far per row: the step counter that seeded rows mix into their seed."""
    all_greedy: bool = False
    any_greedy: bool = False
    need_temperature: bool = False
    need_top_k: bool = False
    need_top_p: bool = False
    need_min_p: bool = False
    max_top_k: int = 0
    """Largest active top-k (for the cheap ``torch.topk`` path when top-p is off)."""
    logit_bias: BatchLogitBias | None = None
    """The rows' ``logit_bias`` entries (None when no row has one)."""
    processor_outputs: list[list[int] | None] | None = None
    """Per row the output ids so far of rows with a ``custom_logit_processor`` (None for the
    others); None when no row has one. Kept up to date by :meth:`advance`."""
    processor_groups: list[ProcessorGroup] = dataclasses.field(default_factory=list)
    """The rows of each named logit processor used in the batch (empty: none is)."""
    token_bitmask: torch.Tensor | None = None
    """Constrained decoding: int32 ``[bs, ceil(V / 32)]`` allowed-token bits of this step
    (:mod:`framework.sampling.grammar_mask`), set by the scheduler each step; None: no row is constrained."""

    @property
    def batch_size(self) -> int:
        return len(self.params)

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        eos_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatchInfo:
        """One batch's sampling state from each request's params and complete token lists.

        ``eos_token_ids`` are per request (a model may have several, e.g. ``<|eot_id|>``), used only
        for min_new_tokens masking. Cost: O(bs) for the parameters plus O(tokens) of the rows that
        use repetition penalty (prompt + output) or frequency/presence penalty (output).
        """
        n = len(params)
        if not (len(prompt_ids) == len(output_ids) == len(eos_token_ids) == n):
            raise ValueError(
                f"params, prompt_ids, output_ids and eos_token_ids must have one entry per request, "
                f"got {n}, {len(prompt_ids)}, {len(output_ids)}, {len(eos_token_ids)}"
            )
        device = torch.device(device)
        penalties = PenaltyState.build(params, prompt_ids, output_ids, eos_token_ids, vocab_size, device)
        return cls._from_rows(
            params,
            vocab_size,
            device,
            penalties,
            [p.seed for p in params],
            [len(out) for out in output_ids],
            _processor_outputs(params, output_ids),
        )

    @classmethod
    def _from_rows(
        cls,
        params: list[SamplingParams],
        vocab_size: int,
        device: torch.device,
        penalties: PenaltyState | None,
        seeds: list[int | None],
        output_lens: list[int],
        processor_outputs: list[list[int] | None] | None = None,
    ) -> SamplingBatchInfo:
        if penalties is not None:
            penalties = penalties.prune(params, output_lens)
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy, strict=True)]
        ks = [vocab_size if p.top_k < 1 or p.top_k >= vocab_size else p.top_k for p in params]
        cutoffs = [1.0 - p.top_p if p.top_p < 1.0 else -1.0 for p in params]
        min_ps = [float(p.min_p) for p in params]
        # One host->device copy for all per-row scalars; float64 holds the ints exactly and each
        # float rounds to float32 once, as torch.tensor(list, dtype=float32) would.
        packed = torch.tensor([temps, cutoffs, min_ps, ks, greedy], dtype=torch.float64).T.contiguous().to(device)
        sampled = [i for i, g in enumerate(greedy) if not g]
        return cls(
            params=params,
            vocab_size=vocab_size,
            device=device,
            temperatures=packed[:, 0:1].float(),
            top_p_cutoffs=packed[:, 1:2].float(),
            min_ps=packed[:, 2:3].float(),
            top_ks=packed[:, 3:4].long(),
            greedy_mask=packed[:, 4].bool(),
            penalties=penalties,
            seeds=seeds,
            output_lens=output_lens,
            all_greedy=not sampled,
            any_greedy=len(sampled) < len(params),
            need_temperature=any(temps[i] != 1.0 for i in sampled),
            need_top_k=any(ks[i] < vocab_size for i in sampled),
            need_top_p=any(cutoffs[i] >= 0 for i in sampled),
            need_min_p=any(min_ps[i] > 0 for i in sampled),
            max_top_k=max((ks[i] for i in sampled if ks[i] < vocab_size), default=0),
            logit_bias=BatchLogitBias.build([p.logit_bias for p in params], device),
            processor_outputs=processor_outputs,
            processor_groups=[] if processor_outputs is None else build_groups(
                [p.custom_logit_processor for p in params], [p.custom_params for p in params],
                [out if out is not None else [] for out in processor_outputs], device),
        )

    # ----------------------------------------------------------------------------------------------
    def advance(self, next_token_ids: torch.Tensor) -> None:
        """Record one generated token per row; call after each step for the rows that go on."""
        if self.penalties is not None:
            self.penalties.advance(next_token_ids)
            if self.penalties.is_empty:
                self.penalties = None
        self.output_lens = [n + 1 for n in self.output_lens]
        if self.processor_outputs is not None:
            tokens = next_token_ids.tolist()
            for row, out in enumerate(self.processor_outputs):
                if out is not None:
                    out.append(tokens[row])

    def filter(self, keep: list[int]) -> SamplingBatchInfo:
        """A new info holding rows ``keep`` (e.g. the unfinished requests), in that order."""
        keep_t = torch.tensor(keep, dtype=torch.long, device=self.device)
        pen = None if self.penalties is None else self.penalties.filter(keep_t)
        return self._from_rows(
            [self.params[i] for i in keep],
            self.vocab_size,
            self.device,
            pen,
            [self.seeds[i] for i in keep],
            [self.output_lens[i] for i in keep],
            None if self.processor_outputs is None else _none_if_empty([self.processor_outputs[i] for i in keep]),
        )

    def merge(self, other: SamplingBatchInfo) -> SamplingBatchInfo:
        """A new info with the rows of ``self`` followed by those of ``other``."""
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"cannot merge vocab sizes {self.vocab_size} and {other.vocab_size}")
        pa, pb = self.penalties, other.penalties
        if pa is None and pb is None:
            pen = None
        else:
            empty_a = PenaltyState(self.batch_size, self.vocab_size, self.device)
            empty_b = PenaltyState(other.batch_size, other.vocab_size, other.device)
            pen = (pa or empty_a).merge(pb or empty_b)
        return self._from_rows(
            self.params + other.params,
            self.vocab_size,
            self.device,
            pen,
            self.seeds + other.seeds,
            self.output_lens + other.output_lens,
            _none_if_empty((self.processor_outputs or [None] * self.batch_size)
                           + (other.processor_outputs or [None] * other.batch_size)),
        )


def _processor_outputs(params: list[SamplingParams], output_ids: list[list[int]]) -> list[list[int] | None] | None:
    """Copies of the output ids of the rows that use a logit processor (None when no row does)."""
    return _none_if_empty([list(out) if p.custom_logit_processor is not None else None
                           for p, out in zip(params, output_ids, strict=True)])


def _none_if_empty(rows: list[list[int] | None]) -> list[list[int] | None] | None:
    return rows if any(r is not None for r in rows) else None


# --------------------------------------------------------------------------------------------------
class Sampler:
    """Chooses the next token of every row of a batch (see the module docstring for semantics)."""

    def __init__(self) -> None:
        # One generator per device, re-seeded per seeded row: re-seeding resets its offset, so a
        # row's noise depends only on the seed it is given.
        self._generators: dict[torch.device, torch.Generator] = {}

    def sample(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        top_logprobs_nums: list[int] | None = None,
        *,
        return_logprobs: bool = True,
        token_ids: list[list[int]] | None = None,
    ) -> SampleOutput:
        """Sample one token per row of ``logits`` ([bs, V] float32, left unmodified).

        ``return_logprobs=False`` skips the [bs, V] log-softmax when no request of the batch wants
        logprobs (``top_logprobs_nums`` still works and computes it if some row asks).
        ``token_ids[i]``: ids whose logprobs row i reports (SGLang's ``token_ids_logprob``).
        """
        _check_shapes(logits, info)
        logits = logits.float()  # no-op for float32; bf16 logits would lose top-p/min-p precision
        biased = apply_logit_bias(logits, info.logit_bias)  # before penalties: the EOS mask wins
        biased = _apply_processors(biased, info)
        scores = info.penalties.apply(biased) if info.penalties is not None else biased
        if info.token_bitmask is not None:  # after penalties: a disallowed token stays impossible
            scores = apply_token_bitmask(scores, info.token_bitmask)
        if info.all_greedy:
            next_ids = argmax_rows(scores)
        else:
            probs = filtered_probs(scores, info, normalize=False)
            # Inverse CDF: one uniform per row picks i with probability p_i / sum(p), with no
            # normalisation and no sync (an exponential race, argmax p_i / E_i, would need a draw
            # per vocabulary entry: ~37 ms a 64-row step on CPU; see framework/kernels/sampling.c).
            next_ids = draw_from_probs(probs, self._uniforms(info, probs.device))
            if info.any_greedy:
                next_ids = torch.where(info.greedy_mask, argmax_rows(scores), next_ids)
        out = _with_logprobs(logits, next_ids, top_logprobs_nums, return_logprobs)
        if token_ids:
            out.token_ids_logprobs = logprobs_of_ids(logits, token_ids)
        return out

    def processed_probs(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """[bs, V] float32 distribution each row samples from: one-hot at the argmax for greedy
        rows. For tests and debugging; :meth:`sample` never materialises the normalised form."""
        _check_shapes(logits, info)
        logits = logits.float()
        biased = _apply_processors(apply_logit_bias(logits, info.logit_bias), info)
        scores = info.penalties.apply(biased) if info.penalties is not None else biased
        if info.token_bitmask is not None:  # after penalties: a disallowed token stays impossible
            scores = apply_token_bitmask(scores, info.token_bitmask)
        probs = filtered_probs(scores, info, normalize=True)
        if info.any_greedy:
            one_hot = torch.zeros_like(probs).scatter_(1, scores.argmax(dim=-1, keepdim=True), 1.0)
            probs = torch.where(info.greedy_mask.unsqueeze(1), one_hot, probs)
        return probs

    def _uniforms(self, info: SamplingBatchInfo, device: torch.device) -> torch.Tensor:
        """[bs] float64 uniforms in [0, 1), one per row: a seeded row's from its own generator
        state, the others' from the global torch RNG."""
        uniforms = torch.rand(info.batch_size, dtype=torch.float64, device=device)
        # The only per-row Python loop: a seeded row needs its own generator state.
        for row, seed in enumerate(info.seeds):
            if seed is None or info.params[row].is_greedy:
                continue
            gen = self._generators.get(device)
            if gen is None:
                gen = self._generators[device] = torch.Generator(device=device)
            gen.manual_seed(mix_seed(seed, info.output_lens[row]))
            uniforms[row] = torch.rand(1, dtype=torch.float64, device=device, generator=gen)[0]
        return uniforms


# --------------------------------------------------------------------------------------------------
def _apply_processors(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The batch's named logit processors (after logit_bias, before penalties), looked up in the
    process's current registry; ``logits`` itself when no row uses one."""
    if not info.processor_groups:
        return logits
    return apply_logit_processors(logits, info.processor_groups, get_registry())


def filtered_probs(scores: torch.Tensor, info: SamplingBatchInfo, normalize: bool = True) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to (already penalised) ``scores``.

    Returns probabilities with filtered tokens at exactly 0. Top-p follows HF exactly: sort
    ascending, cumulative softmax, drop tokens whose cumulative probability is <= 1 - top_p, always
    keep the most likely token. Top-k keeps every token tied with the k-th largest, as HF does.
    """
    if info.need_temperature:
        scores = scores / info.temperatures
    if info.need_top_p:
        scores = _top_k_top_p_sorted(scores, info)
    elif info.need_top_k:
        scores = _top_k_only(scores, info)
    probs = torch.softmax(scores, dim=-1)
    if info.need_min_p:
        # Relative to the most likely token, after the other filters, as HF's MinPLogitsWarper.
        remove = probs < info.min_ps * probs.amax(dim=-1, keepdim=True)
        if normalize:
            # A second softmax rather than dividing by the sum: bit-for-bit what HF computes.
            probs = torch.softmax(scores.masked_fill(remove, float("-inf")), dim=-1)
        else:
            probs = probs.masked_fill(remove, 0.0)  # inverse-CDF drawing needs no normalisation
    return probs


def _top_k_only(scores: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    # torch.topk over max_top_k columns is much cheaper than a full sort of the vocabulary.
    top = torch.topk(scores, info.max_top_k, dim=-1).values
    kth = top.gather(1, (info.top_ks - 1).clamp(max=info.max_top_k - 1))
    kth = torch.where(info.top_ks >= info.vocab_size, float("-inf"), kth)
    return scores.masked_fill(scores < kth, float("-inf"))


def _top_k_top_p_sorted(scores: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    sorted_scores, order = torch.sort(scores, dim=-1)  # ascending, as HF's TopPLogitsWarper
    vocab = scores.shape[-1]
    if info.need_top_k:
        kth = sorted_scores.gather(1, vocab - info.top_ks)  # k == V selects the minimum: no-op
        sorted_scores = sorted_scores.masked_fill(sorted_scores < kth, float("-inf"))
    cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
    remove = cumulative <= info.top_p_cutoffs  # cut-off -1 for rows without top-p: nothing removed
    remove[:, -1] = False
    sorted_scores = sorted_scores.masked_fill(remove, float("-inf"))
    return torch.empty_like(scores).scatter_(1, order, sorted_scores)


def _with_logprobs(
    logits: torch.Tensor, next_ids: torch.Tensor, top_logprobs_nums: list[int] | None, return_logprobs: bool
) -> SampleOutput:
    if not return_logprobs and not top_logprobs_nums:
        return SampleOutput(next_ids, None, None if top_logprobs_nums is None else [[] for _ in top_logprobs_nums])
    # A fused log_softmax is cheaper than logsumexp (a chain of kernels with temporaries) on CPU
    # and GPU alike, and makes top_logprobs exactly topk(log_softmax).
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1) if return_logprobs else None
    top: list[list[tuple[int, float]]] | None = None
    if top_logprobs_nums is not None:
        k = min(max(top_logprobs_nums, default=0), logits.shape[-1])
        top = [[] for _ in top_logprobs_nums]
        if k > 0:
            values, ids = torch.topk(logprobs, k, dim=-1)
            ids_list, lp_list = ids.tolist(), values.tolist()  # the step's only device->host sync
            for row, num in enumerate(top_logprobs_nums):
                top[row] = list(zip(ids_list[row][:num], lp_list[row][:num], strict=True))
    return SampleOutput(next_ids, chosen, top)


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(dim=-1)`` (the first largest entry of each row), by the C kernel on CPU."""
    picked = argmax_rows_kernel(scores)
    return picked if picked is not None else scores.argmax(dim=-1)


def draw_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row the first index whose cumulative probability exceeds ``uniforms[row]`` times the row's
    total (``probs`` need not be normalised; an entry of probability 0 is never drawn)."""
    picked = sample_from_probs(probs, uniforms)
    return picked if picked is not None else inverse_cdf_torch(probs, uniforms)


def logprobs_of_ids(logits: torch.Tensor, token_ids: list[list[int]]) -> list[list[tuple[int, float]]]:
    """Per row, (id, raw-logit logprob) of each id in ``token_ids[row]``: one gather and one
    device->host copy for the batch, rows padded to the longest list."""
    width = max((len(ids) for ids in token_ids), default=0)
    if width == 0:
        return [[] for _ in token_ids]
    padded = torch.tensor([ids + [0] * (width - len(ids)) for ids in token_ids], dtype=torch.int64,
                          device=logits.device)
    values = torch.log_softmax(logits.float(), dim=-1).gather(1, padded).tolist()
    return [list(zip(ids, row[:len(ids)], strict=True)) for ids, row in zip(token_ids, values, strict=True)]


def _check_shapes(logits: torch.Tensor, info: SamplingBatchInfo) -> None:
    if logits.dim() != 2 or logits.shape[0] != info.batch_size or logits.shape[1] != info.vocab_size:
        raise ValueError(f"logits must be [{info.batch_size}, {info.vocab_size}], got {list(logits.shape)}")


def mix_seed(seed: int, step: int) -> int:
    """A 64-bit generator seed from (request seed, step): SplitMix64 finaliser over both, so
    neighbouring seeds and steps give unrelated streams."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    for _ in range(2):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return z
