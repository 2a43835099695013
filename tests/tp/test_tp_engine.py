"""Tensor parallelism through the Engine: two gloo ranks (one thread each) against one rank and
against transformers, on the hidden configs of the parity tests, with every scheduler feature
that changes how KV is computed; RL calls on both ranks; a dead rank stops the engine; the
followers start before rank 0's tokenizer and go when rank 0 fails after starting them."""

from __future__ import annotations

import os
import signal

import pytest
import transformers

from framework import Engine
from framework.testing.tiny_models import save_tiny_model
from tests.engine.test_engine_vs_hf import MAX_NEW, make_prompts
from tests.rl.conftest import hf_greedy as hf_generate

ARCHS = {
    "llama_gqa": ("LlamaForCausalLM", {}),  # 4 heads, 2 KV heads: one KV head per rank
    "llama_tied_mqa": ("LlamaForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=1)),  # KV replicated
    "qwen2": ("Qwen2ForCausalLM", {}),  # q/k/v biases sharded
    "qwen3_head_dim": ("Qwen3ForCausalLM", dict(head_dim=32)),
    "mistral": ("MistralForCausalLM", {}),
}
BASE = ["kv_cache.max_total_tokens=2048", "device.num_threads=1"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            arch, cfg = ARCHS[name]
            # An odd vocabulary (the tokenizer's + 3) so the vocab-parallel split needs padding.
            path = save_tiny_model(tmp_path_factory.mktemp(name), arch, vocab_size=0, **cfg)
            cache[name] = path
        return cache[name]

    return get


def engine(path, tp: int, *extra: str) -> Engine:
    return Engine(overrides=[f"model.path={path}", *BASE, f"parallel.tp_size={tp}", *extra], progress=False)


def run(eng: Engine, prompts: list[list[int]]) -> list[dict]:
    params = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    return eng.generate(prompts, params, return_logprob=True, logprob_start_len=0)


def hf_greedy(path, arch: str, prompts: list[list[int]]) -> list[list[int]]:
    return hf_generate(getattr(transformers, arch).from_pretrained(path).eval(), prompts, MAX_NEW)


def assert_clean(eng: Engine) -> None:
    report = eng.leak_report()
    assert report["leaked"] == 0 and report["protected"] == 0, report
    assert report["req_slots_free"] == report["req_slots_total"], report


@pytest.mark.parametrize("name", list(ARCHS))
def test_tp2_equals_tp1_and_transformers(models, name):
    path = models(name)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    prompts = make_prompts(vocab)
    one = engine(path, 1)
    ref = run(one, prompts)
    one.close()
    two = engine(path, 2)
    try:
        assert two.runner.describe()["tp_size"] == 2
        got = run(two, prompts)
        assert_clean(two)
    finally:
        two.close()
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in ref]
    assert [r["output_ids"] for r in got] == hf_greedy(path, ARCHS[name][0], prompts)
    for a, b in zip(ref, got, strict=True):
        lp_a = [x[0] for x in a["meta_info"]["input_token_logprobs"][1:]]
        lp_b = [x[0] for x in b["meta_info"]["input_token_logprobs"][1:]]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b, strict=True)) < 1e-4


@pytest.mark.parametrize("features", [
    ("scheduler.chunked_prefill_size=8", "kv_cache.page_size=4"),
    ("kv_cache.max_total_tokens=96", "radix_cache.enabled=false"),  # forces retraction
    ("scheduler.overlap=true",),
])
def test_tp2_scheduler_features(models, features):
    path = models("llama_gqa")
    prompts = make_prompts(transformers.AutoConfig.from_pretrained(path).vocab_size)
    expected = hf_greedy(path, "LlamaForCausalLM", prompts)
    two = engine(path, 2, *features)
    try:
        # Staggered arrivals: the second wave joins while the first decodes (radix hits, chunking).
        params = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
        rids = [two.submit(p, params) for p in prompts[:3]]
        for _ in range(3):
            two.step()
        rids += [two.submit(p, params) for p in prompts[3:]]
        two.run_until_done(rids)
        assert [two._states.pop(r).output_ids for r in rids] == expected
        assert_clean(two)
    finally:
        two.close()


def test_tp2_sampling_is_the_same_on_both_ranks(models):
    """Seeded sampling at temperature 1: rank 0's tokens equal one rank's (every rank sampled the
    same gathered logits with the same seed, or the ranks' KV would disagree and the outputs drift)."""
    path = models("qwen2")
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 16, "seed": 7}
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    one = engine(path, 1)
    ref = [r["output_ids"] for r in one.generate(prompts, params)]
    one.close()
    two = engine(path, 2)
    try:
        assert [r["output_ids"] for r in two.generate(prompts, params)] == ref
    finally:
        two.close()


def test_tp2_weight_update_and_release(models, tmp_path):
    """RL calls reach every rank: each updates and releases its own shard."""
    path = models("llama_gqa")
    new = save_tiny_model(tmp_path / "v1", "LlamaForCausalLM", seed=1)
    prompts = make_prompts(transformers.AutoConfig.from_pretrained(path).vocab_size)[:3]
    two = engine(path, 2)
    try:
        before = [r["output_ids"] for r in run(two, prompts)]
        two.release_memory_occupation()
        two.resume_memory_occupation()
        assert [r["output_ids"] for r in run(two, prompts)] == before
        two.update_weights_from_disk(str(new))
        assert [r["output_ids"] for r in run(two, prompts)] == hf_greedy(new, "LlamaForCausalLM", prompts)
        assert_clean(two)
    finally:
        two.close()


def test_dead_rank_is_reported(models):
    two = engine(models("llama_gqa"), 2)
    (proc,) = two.followers.procs.values()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1"):
        two.generate([1, 2, 3], {"max_new_tokens": 2})
    two.followers.procs.clear()  # nothing left to stop
    from framework.distributed.state import set_tensor_parallel

    set_tensor_parallel(None)


class _Spawned:
    """Records the follower processes ``LeaderStart`` spawns (the real ones)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from framework.engine import tensor_parallel

        self.groups: list = []
        real = tensor_parallel.spawn_followers

        def spawn(*args, **kwargs):
            group = real(*args, **kwargs)
            self.groups.append(group)
            return group

        monkeypatch.setattr(tensor_parallel, "spawn_followers", spawn)

    def all_exited(self) -> bool:
        procs = [p for g in self.groups for p in g.procs.values()]
        return bool(procs) and all(p.exitcode is not None for p in procs)


def test_followers_start_before_the_tokenizer_and_go_when_it_fails(models, monkeypatch):
    """Rank 0 spawns its followers first (they spend seconds importing) and loads its tokenizer
    while they start; a tokenizer that fails to load then leaves no follower behind, and no group."""
    from framework.distributed.state import get_tensor_parallel
    from framework.engine import engine as engine_module

    spawned = _Spawned(monkeypatch)
    seen: list[int] = []

    class BrokenTokenizer:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            seen.append(len(spawned.groups))
            raise OSError("tokenizer.json is damaged")

    monkeypatch.setattr(engine_module, "AutoTokenizer", BrokenTokenizer)
    with pytest.raises(OSError, match="damaged"):
        engine(models("llama_gqa"), 2)
    assert seen == [1], "the followers were not spawned before rank 0 loaded its tokenizer"
    assert spawned.all_exited(), "a follower outlived the failed start"
    assert get_tensor_parallel().size == 1


def test_a_failure_after_joining_terminates_the_followers(models, monkeypatch):
    """Rank 0 joined the group, then its model failed to build: the followers (waiting for rank
    0's first call) are terminated, the communicator closed and this process is a single rank again."""
    from framework.distributed.state import get_tensor_parallel
    from framework.engine import engine as engine_module

    spawned = _Spawned(monkeypatch)
    joined: list[int] = []

    def failing_runner(settings, progress=True):
        joined.append(get_tensor_parallel().size)
        raise MemoryError("no room for the weights")

    monkeypatch.setattr(engine_module, "ModelRunner", failing_runner)
    with pytest.raises(MemoryError):
        engine(models("llama_gqa"), 2)
    assert joined == [2]
    assert spawned.all_exited(), "a follower outlived the failed start"
    assert get_tensor_parallel().size == 1
    monkeypatch.undo()
    one = engine(models("llama_gqa"), 1)  # the process is usable again
    assert one.generate([1, 2, 3], {"max_new_tokens": 2, "ignore_eos": True})["meta_info"]["completion_tokens"] == 2
    one.close()
