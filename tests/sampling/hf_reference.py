"""The reference the sampler is checked against: Hugging Face's own logits processors, row by row.

Processors are chained in the order ``GenerationMixin._get_logits_processor`` uses (repetition
penalty, min_new_tokens, then temperature, top-k, top-p, min-p). HF has no OpenAI frequency or
presence penalty, so those are applied by their defining formula right after the repetition
penalty, where vLLM applies them.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from framework.sampling.params import SamplingParams


def frequency_presence_formula(
    logits: torch.Tensor, output_ids: list[int], frequency: float, presence: float
) -> torch.Tensor:
    """OpenAI's definition, one token at a time: mu[j] - c[j] * alpha_freq - (c[j] > 0) * alpha_pres."""
    out = logits.clone()
    for token in set(output_ids):
        count = output_ids.count(token)
        out[..., token] = out[..., token] - (frequency * count + presence * (count > 0))
    return out


def hf_penalised(
    logits_row: torch.Tensor,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
    eos_ids: list[int],
) -> torch.Tensor:
    """[1, V] scores after HF's processors (what greedy decoding takes the argmax of)."""
    input_ids = torch.tensor([prompt + output], dtype=torch.long)
    scores = logits_row.view(1, -1).clone()
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))(input_ids, scores)
    if params.frequency_penalty != 0 or params.presence_penalty != 0:
        scores = frequency_presence_formula(scores, output, params.frequency_penalty, params.presence_penalty)
    if params.min_new_tokens > 0:
        stop_ids = list(dict.fromkeys(eos_ids + params.stop_token_ids))
        processor = MinNewTokensLengthLogitsProcessor(len(prompt), params.min_new_tokens, stop_ids)
        scores = processor(input_ids, scores)
    return scores


def hf_warpers(params: SamplingParams) -> LogitsProcessorList:
    """The warpers HF's ``generate(do_sample=True)`` adds for these params (it skips no-op ones)."""
    warpers = LogitsProcessorList()
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(params.temperature)))
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0:
        warpers.append(MinPLogitsWarper(params.min_p))
    return warpers


def hf_scores(
    logits_row: torch.Tensor,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
    eos_ids: list[int],
) -> torch.Tensor:
    """[V] final scores HF samples from (-inf where filtered), for a sampling (non-greedy) row."""
    scores = hf_penalised(logits_row, params, prompt, output, eos_ids)
    input_ids = torch.tensor([prompt + output], dtype=torch.long)
    return hf_warpers(params)(input_ids, scores)[0]


def hf_probs(
    logits_row: torch.Tensor,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
    eos_ids: list[int],
) -> torch.Tensor:
    """[V] the distribution HF's generate draws the next token from; one-hot for greedy params."""
    if params.is_greedy:
        scores = hf_penalised(logits_row, params, prompt, output, eos_ids)[0]
        return torch.zeros_like(scores).scatter_(0, scores.argmax().view(1), 1.0)
    return torch.softmax(hf_scores(logits_row, params, prompt, output, eos_ids), dim=-1)
