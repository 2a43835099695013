"""PD faults in one process: a peer that never shows up fails the request with a clear error
after the bootstrap timeout, and every page and request slot is freed."""

from __future__ import annotations

import time

import pytest

from framework import Engine
from tests.pd.test_scheduler_pd import COMMON, assert_no_leak, make_req
from tests.server.conftest import free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from framework.testing.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("pd-faults"), "LlamaForCausalLM")


def engine(model_path, mode, port, *extra):
    return Engine(overrides=[f"model.path={model_path}", *COMMON, f"disaggregation.mode={mode}",
                             "disaggregation.transfer_backend=nccl", f"disaggregation.bootstrap_port={port}",
                             "disaggregation.bootstrap_timeout_s=1.5", *extra], progress=False)


def run_until_error(sched, rid, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for o in sched.step():
            if o.rid == rid and o.finished:
                return o
    raise AssertionError("the request neither finished nor failed")


def test_prefill_without_decode_times_out_and_frees(model_path):
    port = free_port()
    e = engine(model_path, "prefill", port)
    try:
        s = e.scheduler
        s.add_request(make_req("a", list(range(10, 50)), 4, "127.0.0.1", port, 1))
        start = time.monotonic()
        out = run_until_error(s, "a")
        assert out.error and "bootstrap timed out" in out.error
        assert out.finish_reason["type"] == "abort"
        assert time.monotonic() - start < 15
        assert_no_leak(e)
    finally:
        e.scheduler.pd.close()


def test_decode_with_unreachable_bootstrap_times_out_and_frees(model_path):
    dead_port = free_port()  # nothing listens there
    e = engine(model_path, "decode", free_port(), "memory_pool.name=decode_prealloc")
    try:
        s = e.scheduler
        s.add_request(make_req("b", list(range(10, 30)), 4, "127.0.0.1", dead_port, 2))
        out = run_until_error(s, "b")
        assert out.error and "bootstrap timed out" in out.error
        assert_no_leak(e)
        # a request without bootstrap fields is refused clearly (the HTTP layer answers 400)
        with pytest.raises(ValueError, match="bootstrap"):
            s.add_request(make_req("c", [1, 2, 3], 2, None, None, None))
        assert "c" not in s.requests and not s.has_work()
    finally:
        e.scheduler.pd.close()


def test_stalled_transfer_times_out_on_both_sides_and_quarantines(model_path):
    """A send that stalls after its header (the test plugin's ``nccl_stalling`` backend)
    fails on both sides with "transfer timed out" after ``transfer_timeout_s``. The decode side's
    pages stay quarantined (held, not reusable) while the late sender may still write them, and
    are freed once it stopped; afterwards a new request goes through."""
    port = free_port()
    stall = ["disaggregation.transfer_backend=nccl_stalling",  # tests/plugins/plugserve-fault-plugin
             "disaggregation.bootstrap_timeout_s=10", "disaggregation.transfer_timeout_s=1",
             "disaggregation.transfer_options.timeout_s=10",
             "disaggregation.transfer_options.stall_rooms=[77]", "disaggregation.transfer_options.stall_s=3"]
    p = engine(model_path, "prefill", port, *stall)
    d = engine(model_path, "decode", free_port(), "memory_pool.name=decode_prealloc", *stall)
    try:
        ps, ds = p.scheduler, d.scheduler
        ps.add_request(make_req("p77", list(range(10, 50)), 4, "127.0.0.1", port, 77))
        ds.add_request(make_req("d77", list(range(10, 50)), 4, "127.0.0.1", port, 77))
        errors: dict[str, str] = {}
        held_while_stalled = False
        deadline = time.monotonic() + 30
        while len(errors) < 2:
            assert time.monotonic() < deadline, f"no failure on both sides: {errors}"
            for s in (ps, ds):
                for o in s.step():
                    if o.finished:
                        errors[o.rid] = o.error or ""
            if "d77" in errors and ds.pd.quarantine:
                held_while_stalled = True
                assert ds.leak_report()["held_by_requests"] > 0  # counted as held, not free
        assert all("transfer timed out" in e for e in errors.values()), errors
        assert held_while_stalled, "the decode pages were freed while the sender could still write them"
        deadline = time.monotonic() + 15
        while ps.has_work() or ds.has_work():  # the sender wakes up and finishes: quarantine ends
            assert time.monotonic() < deadline, "the quarantine never ended"
            ps.step()
            ds.step()
        assert_no_leak(p)
        assert_no_leak(d)
        # both sides keep serving over the same link
        ps.add_request(make_req("p78", list(range(20, 40)), 3, "127.0.0.1", port, 78))
        ds.add_request(make_req("d78", list(range(20, 40)), 3, "127.0.0.1", port, 78))
        done: dict[str, object] = {}
        deadline = time.monotonic() + 30
        while "d78" not in done:
            assert time.monotonic() < deadline, "the request after the timeout did not finish"
            for s in (ps, ds):
                for o in s.step():
                    if o.finished:
                        done[o.rid] = o
        assert done["d78"].error is None and done["d78"].finish_reason["type"] == "length"
    finally:
        p.scheduler.pd.close()
        d.scheduler.pd.close()


def test_a_decode_server_of_another_model_fails_both_sides_at_once(tmp_path):
    """Layouts are checked on model identity, not bytes: a decode server holding another
    architecture's KV (same layers, heads, head_dim and dtype: the same bytes per page) refuses
    the room at once, and tells the prefill server, which fails its request with the same reason."""
    from framework.testing.tiny_models import save_tiny_model

    llama = save_tiny_model(tmp_path / "llama", "LlamaForCausalLM")
    mistral = save_tiny_model(tmp_path / "mistral", "MistralForCausalLM")
    port = free_port()
    pd = [f"disaggregation.bootstrap_port={port}", "disaggregation.bootstrap_timeout_s=30"]
    p = Engine(overrides=[f"model.path={llama}", *COMMON, *pd, "disaggregation.mode=prefill"], progress=False)
    d = Engine(overrides=[f"model.path={mistral}", *COMMON, *pd, "disaggregation.mode=decode",
                          "memory_pool.name=decode_prealloc"], progress=False)
    try:
        ps, ds = p.scheduler, d.scheduler
        ps.add_request(make_req("p1", list(range(10, 30)), 3, "127.0.0.1", port, 501))
        ds.add_request(make_req("d1", list(range(10, 30)), 3, "127.0.0.1", port, 501))
        errors: dict[str, str] = {}
        deadline = time.monotonic() + 20  # well inside the 30 s bootstrap timeout
        while len(errors) < 2:
            assert time.monotonic() < deadline, f"not refused on both sides: {errors}"
            for s in (ps, ds):
                for o in s.step():
                    if o.finished:
                        errors[o.rid] = o.error or ""
        assert all("different model's KV (architecture 'MistralForCausalLM' vs 'LlamaForCausalLM')" in e
                   for e in errors.values()), errors
        assert_no_leak(p)
        assert_no_leak(d)
    finally:
        p.scheduler.pd.close()
        d.scheduler.pd.close()
