"""Scheduler-side pieces of the API surface: the ``priority`` policy and ``token_ids_logprob``.

Priority is checked on a real scheduler with one running slot, so the admission order is the
order requests start; ``token_ids_logprob`` against transformers' own forward pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from framework import Engine
from framework.sampling.params import SamplingParams
from framework.scheduler.admission import AdmissionError
from framework.scheduler.request import Req
from plugins.policies import PriorityOptions, PriorityPolicy


def _engine(model: Path, *overrides: str) -> Engine:
    return Engine(overrides=[f"model.path={model}", "kv_cache.max_total_tokens=1024", *overrides], progress=False)


def _req(rid: str, priority: int | None, **kw) -> Req:
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    return Req(rid=rid, input_ids=[5, 6, 7, 8], sampling_params=params, priority=priority, **kw)


def _start_order(eng: Engine, reqs: list[Req]) -> list[str]:
    """Add every request, then step until idle; the rids in the order their first token came."""
    for r in reqs:
        eng.scheduler.add_request(r)
    started: list[str] = []
    while eng.scheduler.has_work():
        for out in eng.scheduler.step():
            if out.new_token_ids and out.rid not in started:
                started.append(out.rid)
    assert eng.leak_report()["leaked"] == 0
    return started



def test_requests_are_distinct_by_identity() -> None:
    """The scheduler's lists are searched with ``in`` and ``remove``: a request must match only
    itself, never another with equal fields (a resubmitted prompt, two n>1 samples), and cheaply."""
    a, b = _req("same", None), _req("same", None)
    assert a != b and a == a and len({a, b}) == 2
    queue = [a, b]
    queue.remove(b)
    assert queue == [a] and queue[0] is a

def test_priority_policy_orders_by_priority_then_arrival() -> None:
    policy = PriorityPolicy()
    reqs = [_req("a", 0), _req("b", 5), _req("c", None), _req("d", -1), _req("e", 5)]
    for i, r in enumerate(reqs):
        r.arrival_time = float(i)
    assert [r.rid for r in policy.order(reqs, lambda r: 0)] == ["b", "e", "a", "c", "d"]
    low = PriorityPolicy(PriorityOptions(low_values_first=True, default_priority=10))
    assert [r.rid for r in low.order(reqs, lambda r: 0)] == ["d", "a", "b", "e", "c"]


@pytest.mark.parametrize(("low_first", "expected"), [(False, ["hi1", "hi2", "mid", "low"]),
                                                     (True, ["low", "mid", "hi1", "hi2"])])
def test_a_real_scheduler_starts_requests_in_priority_order(tiny_model: Path, low_first: bool,
                                                            expected: list[str]) -> None:
    eng = _engine(tiny_model, "scheduler.policy=priority", "scheduler.max_running_requests=1",
                  f"scheduler.policy_options.low_values_first={str(low_first).lower()}")
    reqs = [_req("mid", 0), _req("hi1", 9), _req("low", -4), _req("hi2", 9)]
    assert _start_order(eng, reqs) == expected


def test_fcfs_refuses_a_nonzero_priority_but_takes_zero(tiny_model: Path) -> None:
    eng = _engine(tiny_model)
    with pytest.raises(AdmissionError, match="priority 3 needs a schedule policy that orders by priority"):
        eng.scheduler.add_request(_req("x", 3))
    assert _start_order(eng, [_req("y", 0), _req("z", None)]) == ["y", "z"]


def test_token_ids_logprob_matches_transformers(tiny_model: Path) -> None:
    eng = _engine(tiny_model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    vocab = hf.config.vocab_size
    watched = [3, 17, vocab - 1]
    prompt = [11, 12, 13, 14, 15]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    req = Req(rid="t", input_ids=prompt, sampling_params=params, return_logprob=True, token_ids_logprob=watched,
              logprob_start_len=0)
    eng.scheduler.add_request(req)
    rows: list = []
    prompt_rows: list = []
    out_ids: list[int] = []
    while eng.scheduler.has_work():
        for out in eng.scheduler.step():
            out_ids += out.new_token_ids
            rows += out.new_token_ids_logprobs or []
            prompt_rows += out.input_token_ids_logprobs or []
    assert len(rows) == len(out_ids) == 4
    assert len(prompt_rows) == len(prompt) and prompt_rows[0] is None  # the first token has no context
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out_ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    for pos, row in enumerate(rows):
        assert [t for t, _ in row] == watched
        expected = ref[len(prompt) - 1 + pos, watched]
        torch.testing.assert_close(torch.tensor([lp for _, lp in row]), expected, rtol=1e-4, atol=1e-4)
    for pos, row in enumerate(prompt_rows[1:], start=1):  # prompt token pos is predicted at pos - 1
        assert [t for t, _ in row] == watched
        torch.testing.assert_close(torch.tensor([lp for _, lp in row]), ref[pos - 1, watched], rtol=1e-4, atol=1e-4)
