"""Engine features beyond greedy parity: observation hooks, stop conditions, n, streaming."""

from __future__ import annotations

import pytest

from framework import Engine
from framework.hookspecs import hookimpl
from framework.testing.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    path = save_tiny_model(tmp_path_factory.mktemp("feat"), "LlamaForCausalLM")
    return Engine(overrides=[f"model.path={path}", "kv_cache.max_total_tokens=2048"], progress=False)


@pytest.fixture(autouse=True)
def no_leak(engine):
    yield
    report = engine.leak_report()
    assert report["leaked"] == 0 and report["protected"] == 0, report
    assert report["req_slots_free"] == report["req_slots_total"]


GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_observation_hooks_fire(engine, register_plugin):
    seen: dict[str, list] = {"scheduled": [], "finished": [], "requests": []}

    class Observer:
        @hookimpl
        def on_batch_scheduled(self, batch):
            seen["scheduled"].append(batch.mode)

        @hookimpl
        def on_batch_finished(self, batch, elapsed_s):
            seen["finished"].append((batch.mode, elapsed_s))

        @hookimpl
        def on_request_finished(self, request):
            seen["requests"].append(request)

    register_plugin(Observer(), "observer")
    out = engine.generate([10, 11, 12, 13], {**GREEDY, "max_new_tokens": 5})
    assert seen["scheduled"][0] == "prefill" and seen["scheduled"].count("decode") == 4
    assert [m for m, _ in seen["finished"]] == seen["scheduled"]
    assert all(t >= 0 for _, t in seen["finished"])
    (req,) = seen["requests"]
    assert req.completion_tokens == 5 and req.prompt_tokens == 4 and req.finish_reason == "length"
    assert req.first_token_time is not None and req.finish_time >= req.first_token_time
    assert out["meta_info"]["completion_tokens"] == 5


def test_stop_token_ids_and_min_new_tokens(engine):
    ref = engine.generate([20, 21, 22], {**GREEDY, "max_new_tokens": 8})["output_ids"]
    stop_tok = ref[3]
    first = ref.index(stop_tok)
    out = engine.generate([20, 21, 22], {**GREEDY, "max_new_tokens": 8, "stop_token_ids": [stop_tok]})
    assert out["output_ids"] == ref[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    # min_new_tokens masks the stop token until reached: output then differs from the greedy ref
    out = engine.generate([20, 21, 22], {**GREEDY, "max_new_tokens": 8, "stop_token_ids": [stop_tok],
                                         "min_new_tokens": 8})
    assert len(out["output_ids"]) == 8 and stop_tok not in out["output_ids"]


def test_stop_string_truncates_text(engine):
    ref = engine.generate([30, 31, 32], {**GREEDY, "max_new_tokens": 10})
    text = ref["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip(f"the greedy text {text!r} has no printable stop candidate in the middle")
    out = engine.generate([30, 31, 32], {**GREEDY, "max_new_tokens": 10, "stop": [stop]})
    assert out["text"] == text[: text.index(stop)]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert out["meta_info"]["finish_reason"]["matched"] == stop


def test_n_samples_with_seed(engine):
    outs = engine.generate([40, 41], {"temperature": 1.0, "max_new_tokens": 6, "n": 3, "seed": 5})
    assert len(outs) == 3
    again = engine.generate([40, 41], {"temperature": 1.0, "max_new_tokens": 6, "n": 3, "seed": 5})
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in again]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1


def test_stream_concatenates_to_generate(engine):
    params = {**GREEDY, "max_new_tokens": 12}
    whole = engine.generate([50, 51, 52], params)
    chunks = list(engine.stream([50, 51, 52], params))
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert chunks[-1]["finished"] and not any(c["finished"] for c in chunks[:-1])


def test_stream_closed_early_aborts(engine):
    gen = engine.stream([60, 61], {**GREEDY, "max_new_tokens": 50})
    next(gen)
    gen.close()  # the consumer went away: the request is aborted and its KV released


def test_admission_errors(engine):
    from framework.scheduler.admission import AdmissionError

    ctx = engine.scheduler.context_len
    with pytest.raises(AdmissionError, match="exceeds the context length"):
        engine.generate([1] * 10, {"max_new_tokens": ctx})
    with pytest.raises(AdmissionError, match="temperature"):
        engine.generate([1, 2], {"temperature": -1.0})
    with pytest.raises(AdmissionError, match="input_ids must be in"):
        engine.generate([10**6], {"max_new_tokens": 2})


def test_running_requests_share_their_prompt_with_later_arrivals(engine):
    """A prompt's KV enters the prefix cache right after its prefill, not only when it finishes,
    and a request sharing an uncached prefix with one in the same prefill batch waits one batch
    so that it hits the cache instead of computing the prefix again."""
    system = list(range(100, 164))  # 64 shared tokens
    params = {**GREEDY, "max_new_tokens": 6}
    first = engine.submit(system + [5, 6], params)
    second = engine.submit(system + [7, 8], params)  # same batch: deferred by the in-batch check
    engine.step()  # prefill of `first` only
    third = engine.submit(system + [9], params)  # arrives while `first` decodes
    engine.run_until_done([first, second, third])
    states = [engine._states.pop(r) for r in (first, second, third)]
    assert states[0].cached_tokens == 0
    assert states[1].cached_tokens >= 64 and states[2].cached_tokens >= 64
    alone = engine.generate(system + [7, 8], params)  # sharing changed nothing in the output
    assert states[1].output_ids == alone["output_ids"]
