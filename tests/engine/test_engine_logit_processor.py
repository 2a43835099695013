"""A third-party logit processor, registered by the test, used by name through the in-process Engine.

The processor forces ``first + len(output_ids)`` at every step, so the expected output is known
without running it: it checks that the Engine carries ``custom_logit_processor`` and
``custom_params`` to the scheduler, and that the processor sees each request's own output so far.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from framework import Engine
from framework.hookspecs import hookimpl
from framework.scheduler.admission import AdmissionError
from framework.testing.tiny_models import save_tiny_model


@dataclass
class CountParams:
    first: int = 0


def count_up(logits: torch.Tensor, params: list, output_ids: list) -> torch.Tensor:
    forced = torch.full_like(logits, float("-inf"))
    for row, (p, out) in enumerate(zip(params, output_ids, strict=True)):
        forced[row, (p or {}).get("first", 0) + len(out)] = 0.0
    return forced


class CountUpPlugin:
    @hookimpl
    def register_logit_processors(self, register):
        register("count_up", lambda: count_up, config=CountParams)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    path = save_tiny_model(tmp_path_factory.mktemp("lp"), "LlamaForCausalLM")
    return Engine(overrides=[f"model.path={path}", "kv_cache.max_total_tokens=2048",
                             "server.enable_custom_logit_processor=true"], progress=False)


def test_a_registered_processor_is_usable_by_name(engine: Engine, register_plugin) -> None:
    register_plugin(CountUpPlugin(), "test-count-up")
    greedy = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
    plain = engine.generate([5, 6, 7], greedy)["output_ids"]
    results = engine.generate([[5, 6, 7], [8, 9], [5, 6, 7]], [
        {**greedy, "custom_logit_processor": "count_up", "custom_params": {"first": 20}},
        {**greedy, "custom_logit_processor": "count_up", "custom_params": {"first": 40}},
        greedy,
    ])
    assert [r["output_ids"] for r in results] == [[20, 21, 22, 23, 24], [40, 41, 42, 43, 44], plain]
    # sampled rows too: the processor leaves one finite logit
    sampled = engine.generate([5, 6], {"temperature": 1.0, "max_new_tokens": 3, "ignore_eos": True,
                                       "custom_logit_processor": "count_up", "custom_params": {"first": 7}})
    assert sampled["output_ids"] == [7, 8, 9]


def test_bad_names_and_params_are_refused_at_admission(engine: Engine, register_plugin) -> None:
    register_plugin(CountUpPlugin(), "test-count-up-refusals")
    with pytest.raises(AdmissionError, match="custom_logit_processor 'count_down' is not a registered.*count_up"):
        engine.generate([5, 6], {"custom_logit_processor": "count_down"})
    with pytest.raises(AdmissionError, match="custom_params for 'count_up' are invalid"):
        engine.generate([5, 6], {"custom_logit_processor": "count_up", "custom_params": {"last": 3}})


class SeenPlugin:
    """Forces token ``first`` + (sum of the outputs so far) % 50: wrong if any id it is given is."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def __call__(self, logits, params, output_ids):
        forced = torch.full_like(logits, float("-inf"))
        for row, (p, out) in enumerate(zip(params, output_ids, strict=True)):
            self.seen.append(list(out))
            forced[row, p["first"] + sum(out) % 50] = 0.0
        return forced

    @hookimpl
    def register_logit_processors(self, register):
        register("sum_mod", lambda: self, config=CountParams)


def test_the_overlap_loop_hands_a_processor_real_tokens(tmp_path_factory, register_plugin) -> None:
    """With ``scheduler.overlap`` the next step is launched before this step's token is known; a
    request with a processor falls back to the normal loop, so the ids it is handed are real."""
    plugin = SeenPlugin()
    register_plugin(plugin, "test-sum-mod")
    path = save_tiny_model(tmp_path_factory.mktemp("lp-overlap"), "LlamaForCausalLM")
    eng = Engine(overrides=[f"model.path={path}", "kv_cache.max_total_tokens=2048", "scheduler.overlap=true",
                            "server.enable_custom_logit_processor=true"], progress=False)
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True, "custom_logit_processor": "sum_mod",
              "custom_params": {"first": 3}}
    plain = {k: v for k, v in params.items() if not k.startswith("custom")}
    out = eng.generate([[5, 6, 7], [9, 10]], [params, plain])
    expected = [3]
    while len(expected) < 6:
        expected.append(3 + sum(expected) % 50)
    assert out[0]["output_ids"] == expected
    assert plugin.seen == [expected[:i] for i in range(6)]
