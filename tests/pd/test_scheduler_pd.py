"""PD scheduling in one process: a prefill and a decode scheduler linked by the ``nccl`` backend
(gloo on CPU) give exactly the unified scheduler's greedy tokens, and leak nothing.

The two schedulers are stepped alternately from the test thread; the backend moves bytes on its
own threads and the bootstrap service answers from its own thread, as in the servers.
"""

from __future__ import annotations

import itertools
import random
import time

import pytest

from framework import Engine
from framework.sampling.params import SamplingParams
from framework.scheduler.request import Req
from framework.testing.tiny_models import save_tiny_model
from tests.server.conftest import free_port

pytestmark = pytest.mark.timeout(120)

COMMON = ["kv_cache.max_total_tokens=2048", "kv_cache.page_size=4", "scheduler.chunked_prefill_size=32",
          "device.num_threads=1"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("pd"), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def unified(model_path):
    return Engine(overrides=[f"model.path={model_path}", *COMMON], progress=False)


def pd_pair(model_path, *decode_extra, backend="nccl"):
    port = free_port()
    pd = [f"disaggregation.transfer_backend={backend}", f"disaggregation.bootstrap_port={port}",
          "disaggregation.bootstrap_timeout_s=30", "disaggregation.transfer_timeout_s=30"]
    prefill = Engine(overrides=[f"model.path={model_path}", *COMMON, *pd, "disaggregation.mode=prefill"],
                     progress=False)
    decode = Engine(overrides=[f"model.path={model_path}", *COMMON, *pd, "disaggregation.mode=decode",
                               *decode_extra], progress=False)
    return prefill, decode, port


def close(*engines):
    for e in engines:
        if e.scheduler.pd is not None:
            e.scheduler.pd.close()


def make_req(rid, ids, max_new, *bootstrap):
    """``bootstrap``: (port, room) or (host, port, room)."""
    host, port, room = bootstrap if len(bootstrap) == 3 else ("127.0.0.1", *bootstrap)
    sp = SamplingParams.from_dict({"temperature": 0.0, "ignore_eos": True, "max_new_tokens": max_new})
    return Req(rid=rid, input_ids=list(ids), sampling_params=sp, bootstrap_host=host,
               bootstrap_port=port, bootstrap_room=room)


def drive(schedulers, rids, timeout_s=90.0):
    """Step every scheduler until each rid has finished on the last one; outputs per scheduler."""
    outs = [dict() for _ in schedulers]
    errors = {}
    deadline = time.monotonic() + timeout_s
    while not all(r in outs[-1] and outs[-1][r]["finished"] for r in rids):
        assert time.monotonic() < deadline, "PD requests did not finish"
        for s, got in zip(schedulers, outs, strict=True):
            if not s.has_work():
                continue
            for o in s.step():
                entry = got.setdefault(o.rid, {"ids": [], "finished": False})
                entry["ids"].extend(o.new_token_ids)
                entry["finished"] = o.finished
                if o.error:
                    errors[o.rid] = o.error
    return outs, errors


def assert_no_leak(engine):
    deadline = time.monotonic() + 10
    while engine.scheduler.has_work() and time.monotonic() < deadline:
        engine.scheduler.step()
    report = engine.leak_report()
    assert report["leaked"] == 0 and report["protected"] == 0 and report["held_by_requests"] == 0, report
    assert report["req_slots_free"] == report["req_slots_total"], report


@pytest.mark.parametrize("backend", ["nccl", "mooncake"])
def test_pd_greedy_tokens_equal_unified(model_path, unified, backend):
    if backend == "mooncake":
        pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine(-non-cuda) is not installed")
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 300) for _ in range(n)] for n in (3, 9, 17, 40, 70, 5, 33, 64)]
    max_new = [8, 1, 12, 5, 9, 16, 3, 7]
    ref = [unified.generate(p, {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": m})["output_ids"]
           for p, m in zip(prompts, max_new, strict=True)]
    prefill, decode, port = pd_pair(model_path, backend=backend)
    try:
        rooms = itertools.count(1000)
        rids = []
        for i, (p, m) in enumerate(zip(prompts, max_new, strict=True)):
            room = next(rooms)
            rid = f"r{i}"
            prefill.scheduler.add_request(make_req(rid, p, m, port, room))
            decode.scheduler.add_request(make_req(rid, p, m, port, room))
            rids.append(rid)
        (p_out, d_out), errors = drive([prefill.scheduler, decode.scheduler], rids)
        assert not errors
        for i, rid in enumerate(rids):
            assert d_out[rid]["ids"] == ref[i], rid
            assert p_out[rid]["ids"] == ref[i][:1]  # the prefill server reports the first token
        assert_no_leak(prefill)
        assert_no_leak(decode)
    finally:
        close(prefill, decode)


def test_decode_preallocates_beyond_running_cap_and_keeps_reserve(model_path):
    """Running cap 2 + 2 pre-allocation rows: four requests are reserved at once, only two run;
    a reserve of KV per running request holds back further pre-allocation."""
    prefill, decode, port = pd_pair(
        model_path, "scheduler.max_running_requests=2", "memory_pool.options.pre_alloc_size=2",
    )
    try:
        ds = decode.scheduler
        prompts = [[7 + i] * 12 for i in range(6)]
        rids = []
        for i, p in enumerate(prompts):
            rids.append(f"q{i}")
            prefill.scheduler.add_request(make_req(f"q{i}", p, 30, port, 2000 + i))
            ds.add_request(make_req(f"q{i}", p, 30, port, 2000 + i))
        max_reserved = max_running = 0
        deadline = time.monotonic() + 90
        done = set()
        while len(done) < len(rids):
            assert time.monotonic() < deadline
            prefill.scheduler.step() if prefill.scheduler.has_work() else None
            for o in ds.step():
                if o.finished:
                    done.add(o.rid)
            max_running = max(max_running, len(ds.running))
            assert ds.runner.req_pool.running_count() <= 2
            max_reserved = max(max_reserved, len(ds.running) + len(ds.pd.transferring))
        assert max_running == 2
        assert max_reserved == 4  # pre-allocated beyond the running cap, bounded by the pool
        assert_no_leak(decode)
        assert_no_leak(prefill)

        # the reserve: each running request holds back the whole KV, so while one runs nothing
        # else is pre-allocated (FIFO: the rest wait in the queue, none in transfer)
        ds.pd.cfg.decode_reserved_tokens_per_request = ds.kv.total_tokens()
        rids = [f"z{i}" for i in range(3)]

        def add(i):
            prefill.scheduler.add_request(make_req(rids[i], prompts[i], 20, port, 3000 + i))
            ds.add_request(make_req(rids[i], prompts[i], 20, port, 3000 + i))

        def step_both():
            prefill.scheduler.step() if prefill.scheduler.has_work() else None
            for o in ds.step():
                if o.finished:
                    done.add(o.rid)

        done.clear()
        deadline = time.monotonic() + 90
        add(0)
        while not ds.running:
            assert time.monotonic() < deadline
            step_both()
        add(1)
        add(2)
        for _ in range(5):  # z0 runs: z1 and z2 stay queued for pre-allocation
            step_both()
            assert len(ds.running) == 1 and not ds.pd.transferring and len(ds.pd.prealloc) == 2
        while len(done) < len(rids):
            assert time.monotonic() < deadline
            step_both()
        assert_no_leak(decode)
        assert_no_leak(prefill)
    finally:
        close(prefill, decode)


def test_aborts_on_both_sides_free_everything(model_path):
    prefill, decode, port = pd_pair(model_path)
    try:
        ps, ds = prefill.scheduler, decode.scheduler
        # prefill side: prefilled, waiting for a destination that never comes
        ps.add_request(make_req("p", list(range(20, 60)), 4, port, 4000))
        deadline = time.monotonic() + 30
        while not ps.pd.outgoing:
            assert time.monotonic() < deadline
            ps.step()
        assert ps.abort("p", "client went away")
        out = [o for o in ps.step() if o.rid == "p"]
        assert out and out[-1].finished and out[-1].error == "client went away"
        assert_no_leak(prefill)
        # decode side: reserved and posted, its KV never sent
        ds.add_request(make_req("d", list(range(20, 60)), 4, port, 4001))
        while not (ds.pd.transferring and ps.pd.links is not None and ds.pd.connected):
            assert time.monotonic() < deadline
            ds.step()
            ps.step()  # the prefill side joins the link once the decode side registered
        assert ds.abort("d", "client went away")
        ds.step()
        assert not ds.pd.has_work()
        assert_no_leak(decode)
    finally:
        close(prefill, decode)
