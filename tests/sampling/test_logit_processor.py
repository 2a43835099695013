"""Named logit processors in the batched sampler, and the checks a request's fields go through.

The processors here are registered by the test (``register_plugin``), as a third-party plugin
would; what they should do to the logits is written out directly with torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from framework.hookspecs import hookimpl
from framework.sampling.logit_processor import check_custom_logit_processor
from framework.sampling.params import SamplingParams
from framework.sampling.sampler import Sampler, SamplingBatchInfo

VOCAB = 12


@dataclass
class AddParams:
    amount: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.amount, (int, float)):
            raise ValueError(f"amount must be a number, got {self.amount!r}")


class Recorder:
    """Adds ``amount`` to column ``len(output_ids)`` of each row and remembers what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list, list]] = []

    def __call__(self, logits, params, output_ids):
        self.calls.append((logits.shape[0], [dict(p or {}) for p in params], [list(o) for o in output_ids]))
        for row, (p, out) in enumerate(zip(params, output_ids, strict=True)):
            logits[row, len(out)] += (p or {}).get("amount", 0.0)
        return logits


class Plugin:
    def __init__(self) -> None:
        self.recorder = Recorder()

    @hookimpl
    def register_logit_processors(self, register):
        register("test_add", lambda: self.recorder, config=AddParams)
        register("test_negate", lambda: lambda logits, params, out: -logits)


@pytest.fixture
def plugin(register_plugin, request) -> Plugin:
    p = Plugin()
    # a name per test: the registry is rebuilt when the set of plugin names changes
    register_plugin(p, f"test-logit-processors-{request.node.name}")
    return p


def _info(params: list[SamplingParams], outputs: list[list[int]]) -> SamplingBatchInfo:
    return SamplingBatchInfo.build(params, [[1]] * len(params), outputs, [[0]] * len(params), VOCAB, "cpu")


def test_each_group_gets_only_its_rows_in_batch_order(plugin: Plugin) -> None:
    greedy = {"temperature": 0.0}
    params = [
        SamplingParams(**greedy, custom_logit_processor="test_add", custom_params={"amount": 50.0}),
        SamplingParams(**greedy),
        SamplingParams(**greedy, custom_logit_processor="test_negate"),
        SamplingParams(**greedy, custom_logit_processor="test_add", custom_params={"amount": 70.0}),
    ]
    outputs = [[3, 4], [5], [], [6, 7, 8]]
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    original = logits.clone()
    info = _info(params, outputs)
    probs = Sampler().processed_probs(logits, info)
    assert torch.equal(logits, original)  # the caller's logits are left alone

    expected = original.clone()
    expected[0, 2] += 50.0
    expected[3, 3] += 70.0
    expected[2] = -expected[2]
    assert probs.argmax(dim=-1).tolist() == expected.argmax(dim=-1).tolist() == [2, int(original[1].argmax()),
                                                                                 int((-original[2]).argmax()), 3]
    assert plugin.recorder.calls == [(2, [{"amount": 50.0}, {"amount": 70.0}], [[3, 4], [6, 7, 8]])]


def test_output_ids_follow_advance_and_filter(plugin: Plugin) -> None:
    params = [SamplingParams(temperature=0.0, custom_logit_processor="test_add", custom_params={"amount": 100.0}),
              SamplingParams(temperature=0.0)]
    info = _info(params, [[], [9]])
    sampler = Sampler()
    picks = []
    for _ in range(3):
        out = sampler.sample(torch.zeros(info.batch_size, VOCAB), info, return_logprobs=False)
        picks.append(out.next_token_ids.tolist())
        info.advance(out.next_token_ids)
    # the processor row takes column len(output) each step: 0, 1, 2
    assert [p[0] for p in picks] == [0, 1, 2]
    assert plugin.recorder.calls[-1][2] == [[0, 1]]
    kept = info.filter([0])
    sampler.sample(torch.zeros(1, VOCAB), kept, return_logprobs=False)
    assert plugin.recorder.calls[-1][2] == [[0, 1, 2]]
    assert info.filter([1]).processor_groups == []


def test_the_request_checks(plugin: Plugin) -> None:
    from framework.plugins import get_registry

    registry = get_registry()

    def refusal(name, params=None, enabled=True) -> str:
        with pytest.raises(ValueError) as err:
            check_custom_logit_processor(name, params, enabled, registry)
        return str(err.value)

    check_custom_logit_processor("test_add", {"amount": 1}, True, registry)
    check_custom_logit_processor(None, None, False, registry)
    assert "server.enable_custom_logit_processor=true" in refusal("test_add", enabled=False)
    unknown = refusal("nope")
    assert unknown.startswith("custom_logit_processor 'nope' is not a registered")
    assert "test_add" in unknown and "test_negate" in unknown and "disallowed_tokens" in unknown
    sglang_form = '{"callable": "8004954b000000000000008c0a64696c6c2e5f64696c6c"}'
    message = refusal(sglang_form)
    assert message.startswith("custom_logit_processor") and "never runs code" in message and "dill" in message
    assert refusal("test_add", {"amount": "x"}).startswith("custom_params for 'test_add' are invalid")
    assert "amount" in refusal("test_add", {"volume": 1})
    assert refusal(None, {"amount": 1}).startswith("custom_params")
