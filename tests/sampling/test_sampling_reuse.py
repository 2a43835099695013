"""Reusing a decode step's sampling info for the next step of the same batch
(framework/scheduler/sampling_reuse.py): what it hands out must equal a fresh
``SamplingBatchInfo.build`` at every step, and anything it cannot advance is rebuilt."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from framework import Engine
from framework.sampling.params import SamplingParams
from framework.sampling.sampler import SamplingBatchInfo
from framework.scheduler.sampling_reuse import SamplingInfoReuse
from framework.testing.tiny_models import save_tiny_model

V = 50
TENSORS = ("temperatures", "top_ks", "top_p_cutoffs", "min_ps", "greedy_mask")
FLAGS = ("seeds", "output_lens", "all_greedy", "any_greedy", "need_temperature", "need_top_k", "need_top_p",
         "need_min_p", "max_top_k")


def _build(reqs: list[SimpleNamespace]) -> SamplingBatchInfo:
    return SamplingBatchInfo.build([r.params for r in reqs], [[1, 2]] * len(reqs), [r.output_ids for r in reqs],
                                   [[0]] * len(reqs), V, "cpu")


def _assert_same(got: SamplingBatchInfo, want: SamplingBatchInfo) -> None:
    for name in TENSORS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in FLAGS:
        assert getattr(got, name) == getattr(want, name), name
    assert (got.logit_bias is None) == (want.logit_bias is None)


def _reqs(*params: SamplingParams) -> list[SimpleNamespace]:
    return [SimpleNamespace(params=p, output_ids=[7] * i) for i, p in enumerate(params)]


def test_a_kept_info_equals_a_fresh_build_at_every_step() -> None:
    reqs = _reqs(SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=0.0),
                 SamplingParams(temperature=1.3, top_k=5, top_p=0.9, min_p=0.05, logit_bias={4: 2.0}),
                 SamplingParams(temperature=1.0, min_new_tokens=1))  # min_new_tokens met: pruned away
    reuse = SamplingInfoReuse()
    reuse.keep(reqs, _build(reqs))
    for step in range(5):
        for r in reqs:
            r.output_ids.append(step)
        info = reuse.take(reqs)
        assert info is not None, step
        _assert_same(info, _build(reqs))


@pytest.mark.parametrize("change", ["order", "other_request", "two_tokens", "no_token", "fewer"])
def test_a_changed_batch_is_rebuilt(change: str) -> None:
    reqs = _reqs(SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0.9))
    reuse = SamplingInfoReuse()
    reuse.keep(reqs, _build(reqs))
    for r in reqs:
        r.output_ids.append(1)
    if change == "order":
        reqs = reqs[::-1]
    elif change == "other_request":
        reqs = [reqs[0], SimpleNamespace(params=reqs[1].params, output_ids=list(reqs[1].output_ids))]
    elif change == "two_tokens":
        reqs[0].output_ids.append(2)
    elif change == "no_token":
        reqs[1].output_ids.pop()
    else:
        reqs = reqs[:1]
    assert reuse.take(reqs) is None


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, repetition_penalty=1.2),
                                    SamplingParams(temperature=0.8, frequency_penalty=0.5),
                                    SamplingParams(temperature=0.8, min_new_tokens=10)])
def test_an_info_with_penalties_is_not_kept(params: SamplingParams) -> None:
    """Penalty state follows the tokens themselves: those batches are built every step."""
    reqs = _reqs(params)
    reuse = SamplingInfoReuse()
    reuse.keep(reqs, _build(reqs))
    reqs[0].output_ids.append(1)
    assert reuse.take(reqs) is None


def test_seeded_tokens_do_not_depend_on_reuse(tmp_path) -> None:
    """A seeded request decodes alone (every step reuses the info) and beside a request that ends
    early (the batch changes, the info is rebuilt): the same tokens, and each step draws anew."""
    path = save_tiny_model(tmp_path, "LlamaForCausalLM")
    engine = Engine(overrides=[f"model.path={path}", "kv_cache.max_total_tokens=2048"], progress=False)
    seeded = {"temperature": 1.5, "max_new_tokens": 24, "seed": 11, "ignore_eos": True}
    alone = engine.generate([30, 31, 32], seeded)["output_ids"]
    short = {"temperature": 1.0, "max_new_tokens": 3, "ignore_eos": True}
    together = engine.generate([[30, 31, 32], [40, 41]], [seeded, short])[0]["output_ids"]
    assert together == alone
    assert len(set(alone)) > 3, "the step counter must advance: fresh draws each step"
    report = engine.leak_report()
    assert report["leaked"] == 0
