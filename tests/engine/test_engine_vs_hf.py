"""The Engine (scheduler + KV memory + sampler + model plugins) against transformers' generate.

Greedy token ids must equal transformers' exactly for a batch of prompts of different lengths that
arrive at different times, under every scheduler feature that changes how KV is computed: radix
cache on/off, page sizes 1 and 16, chunked prefill smaller than the prompts, a KV budget that
forces retraction, and the overlap loop. After every engine test, no KV page or request row leaks.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch
import transformers

from framework import Engine
from framework.models.cpu_linear import packable_dtypes
from framework.testing.tiny_models import save_tiny_model

MAX_NEW = 12
ARCHS = {
    "llama_gqa": ("LlamaForCausalLM", {}),
    "llama_tied": ("LlamaForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "llama3_rope": (
        "LlamaForCausalLM",
        dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=32)),
    ),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3_head_dim": ("Qwen3ForCausalLM", dict(head_dim=32)),
    "mistral": ("MistralForCausalLM", {}),
}


def make_prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    """Mixed lengths; some share prefixes (radix hits), one repeats another exactly."""
    rng = random.Random(seed)
    base = [rng.randrange(vocab) for _ in range(40)]
    prompts = [
        [rng.randrange(vocab) for _ in range(5)],
        base[:33],
        base[:33] + [rng.randrange(vocab) for _ in range(7)],  # extends a cached prompt
        [rng.randrange(vocab) for _ in range(19)],
        base[:21] + [rng.randrange(vocab) for _ in range(3)],
        base[:33],  # identical to prompt 1
        [rng.randrange(vocab) for _ in range(2)],
    ]
    return prompts


class ModelCases:
    """Tiny checkpoints and their transformers reference outputs, built once per architecture."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._factory = tmp_path_factory
        self._cases: dict[str, tuple] = {}

    def get(self, name: str) -> tuple:
        if name not in self._cases:
            self._cases[name] = self._build(name)
        return self._cases[name]

    def _build(self, name: str) -> tuple:
        arch, cfg = ARCHS[name]
        path = save_tiny_model(self._factory.mktemp(name), arch, **cfg)
        hf = getattr(transformers, arch).from_pretrained(path).eval()
        hf.generation_config.eos_token_id = None  # generate exactly MAX_NEW tokens, like ignore_eos
        prompts = make_prompts(hf.config.vocab_size)
        expected = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p])
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                  do_sample=False, pad_token_id=0)
                expected.append(out[0, len(p):].tolist())
        return name, path, hf, prompts, expected


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> ModelCases:
    return ModelCases(tmp_path_factory)


@pytest.fixture
def llama(cases) -> tuple:
    return cases.get("llama_gqa")


@pytest.fixture
def make_engine(engine_factory):
    """Build engines; after the test, each must be idle with nothing leaked (tests/conftest.py)."""
    return engine_factory


def run_staggered(eng: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Three waves: the second arrives while the first decodes, the third once the first is done
    (so identical and prefix-sharing prompts can hit the prefix cache)."""
    params = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    waves = [prompts[:3], prompts[3:5], prompts[5:]]
    rids = [eng.submit(p, params) for p in waves[0]]
    for _ in range(3):
        eng.step()
    rids += [eng.submit(p, params) for p in waves[1]]
    eng.run_until_done(rids[:3])
    rids += [eng.submit(p, params) for p in waves[2]]
    eng.run_until_done(rids)
    return [eng._states.pop(r).output_ids for r in rids]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_equals_transformers(cases, make_engine, arch):
    _, path, _, prompts, expected = cases.get(arch)
    eng = make_engine(path)
    assert run_staggered(eng, prompts) == expected
    # Decode steps ran every layer in one C call (framework.models.fused_decode), except Qwen3's,
    # whose per-head q/k norms are not in that chain.
    fused_steps = eng.runner.model.model.fused_decoder.fused_steps
    assert fused_steps == 0 if arch.startswith("qwen3") else fused_steps > 0


SCHEDULER_VARIANTS = {
    "radix_off": ["radix_cache.enabled=false"],
    "page16": ["kv_cache.page_size=16"],
    "chunked": ["scheduler.chunked_prefill_size=8"],
    "chunked_page16": ["scheduler.chunked_prefill_size=8", "kv_cache.page_size=16"],
    "lpm_policy": ["scheduler.policy=lpm"],
    "small_prefill_budget": ["scheduler.max_prefill_tokens=16"],
    "overlap": ["scheduler.overlap=true"],
    "overlap_chunked_page16": ["scheduler.overlap=true", "scheduler.chunked_prefill_size=8", "kv_cache.page_size=16"],
    # Mixed steps: the second wave prefills in chunks inside the first wave's decode steps (from
    # one running request on, where CPU's auto setting waits for 32).
    "mixed_chunked": ["scheduler.mixed_chunk=true", "scheduler.mixed_chunk_min_running=1",
                      "scheduler.chunked_prefill_size=8"],
    "mixed_page16": ["scheduler.mixed_chunk=true", "scheduler.mixed_chunk_min_running=1", "kv_cache.page_size=16",
                     "scheduler.mixed_chunk_max_tokens=24"],
    "torch_native_mixed": ["attention.backend=torch_native", "scheduler.mixed_chunk=true",
                           "scheduler.mixed_chunk_min_running=1", "scheduler.chunked_prefill_size=8"],
    "mixed_off": ["scheduler.mixed_chunk=false"],
    # The CPU defaults are the cpu_paged backend and oneDNN-packed linears; the reference paths too:
    "torch_native_aten": ["attention.backend=torch_native", "device.cpu_linear=aten"],
    "torch_native_page16": ["attention.backend=torch_native", "kv_cache.page_size=16"],
    # Decode steps' few rows run the small-GEMM kernel by default (auto); oneDNN alone as well:
    "onednn_small_rows": ["device.cpu_small_gemm=onednn"],
    # ... and decode steps layer by layer through the modules instead of the fused C chain:
    "modules_decode": ["device.cpu_fused_decode=false"],
}


# Scheduler variants run on two architectures (GQA Llama; Qwen3 with its own head_dim) to bound the time.
@pytest.mark.parametrize("arch", ["llama_gqa", "qwen3_head_dim"])
@pytest.mark.parametrize("variant", list(SCHEDULER_VARIANTS))
def test_greedy_equal_under_scheduler_variants(cases, make_engine, variant, arch):
    name, path, _, prompts, expected = cases.get(arch)
    eng = make_engine(path, *SCHEDULER_VARIANTS[variant])
    assert run_staggered(eng, prompts) == expected
    want_backend = "torch_native" if variant.startswith("torch_native") else "cpu_paged"
    assert eng.runner.attn_backend.__class__.__name__.lower().startswith(want_backend.replace("_", ""))
    assert eng.runner.linear_impl == ("aten" if "device.cpu_linear=aten" in SCHEDULER_VARIANTS[variant] else "onednn")
    assert eng.runner.small_gemm == (eng.runner.linear_impl == "onednn" and variant != "onednn_small_rows")
    if variant != "radix_off":
        assert eng.scheduler.cache_hit_tokens > 0  # shared prefixes were reused
    else:
        assert eng.scheduler.cache_hit_tokens == 0


@pytest.mark.parametrize("prefill_gemm", ["aten", "onednn", "kernel"])
def test_large_prefill_equals_transformers_on_either_gemm(cases, make_engine, monkeypatch, prefill_gemm):
    """``device.cpu_prefill_gemm``: one prefill of eight 40-token prompts (320 rows, past
    ``cpu_linear.BLAS_MIN_ROWS`` and the small-GEMM kernel's rows) runs its GEMMs through
    ``F.linear`` on the dense copies (aten), oneDNN's packed weights, or the panel GEMM on the
    small-GEMM copy (kernel); the greedy tokens are transformers' each way, and the chosen path is
    the one that ran."""
    from framework.kernels import panel_gemm
    from framework.models import cpu_linear

    if prefill_gemm == "kernel" and not panel_gemm.kernel_available():
        pytest.skip("the panel GEMM needs a C compiler and a CPU with AVX2 and FMA")
    _, path, hf, _, _ = cases.get("llama_gqa")
    rng = random.Random(5)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(40)] for _ in range(8)]
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                              pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    blas_calls: list[bool] = []
    panel_rows: list[int] = []
    real_blas, real_panel = cpu_linear._blas_rows, cpu_linear.panel_linear
    monkeypatch.setattr(cpu_linear, "_blas_rows", lambda x, w: blas_calls.append(real_blas(x, w)) or blas_calls[-1])
    monkeypatch.setattr(cpu_linear, "panel_linear",
                        lambda x, *a, **kw: panel_rows.append(x.shape[0]) or real_panel(x, *a, **kw))
    eng = make_engine(path, f"device.cpu_prefill_gemm={prefill_gemm}")
    assert eng.runner.prefill_gemm == prefill_gemm and eng.runner.prefill_blas is (prefill_gemm == "aten")
    params = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    rids = [eng.submit(p, params) for p in prompts]
    eng.run_until_done(rids)
    assert [eng._states.pop(r).output_ids for r in rids] == expected
    assert any(blas_calls) is (prefill_gemm == "aten")
    # The decoder layers' projections saw all 320 rows: four a layer, but only QKV in the last one,
    # whose attention output is needed at each prompt's last row only.
    layers = hf.config.num_hidden_layers
    assert (panel_rows.count(320) == 4 * layers - 3) is (prefill_gemm == "kernel")


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen3_head_dim"])
def test_bf16_kv_cache_kernel_equals_sdpa_path(cases, make_engine, arch):
    """``kv_cache.dtype=bfloat16`` on an fp32 model: cpu_paged's kernel reads the bf16 cache itself;
    torch_native gathers the same bf16 values and runs SDPA. Transformers has no bf16-KV mode to
    compare with, so SDPA over the identical cache contents is the reference; the tokens must agree,
    and the kernel path must really be the one taken (not the fallback)."""
    name, path, _, prompts, _ = cases.get(arch)
    paged = make_engine(path, "kv_cache.dtype=bfloat16")
    assert paged.runner.kv_cache.dtype == torch.bfloat16
    calls = []
    kernel_mod = sys.modules[type(paged.runner.attn_backend).__module__]
    real = kernel_mod.paged_decode_attention
    kernel_mod.paged_decode_attention = lambda *a: (calls.append(a[1].dtype), real(*a))[1]
    try:
        got = run_staggered(paged, prompts)
    finally:
        kernel_mod.paged_decode_attention = real
    if arch.startswith("qwen3"):
        assert calls and set(calls) == {torch.bfloat16}
    else:  # decode steps ran in the fused C chain, whose attention is this kernel (the kit checks it bitwise)
        assert not calls and paged.runner.model.model.fused_decoder.fused_steps > 0
    reference = run_staggered(make_engine(path, "kv_cache.dtype=bfloat16", "attention.backend=torch_native"), prompts)
    assert got == reference


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen3_head_dim"])
def test_bf16_model_runs_on_the_kernels(cases, make_engine, arch):
    """A bf16 model on cpu_paged: decode and extend both go through the C kernels (decode takes the
    bf16 query as it is and widens it inside, extend's is widened to fp32 before unless it runs on
    AMX tiles; the bf16 cache read as it is), not the gather + SDPA fallback. Its greedy tokens are
    checked teacher-forced against transformers in bf16: each is transformers' argmax or within two
    bf16 spacings of its largest logit (transformers' logits are bf16: at |logit| 8-16 neighbours
    are 0.0625 apart, so two bf16 paths that round at different points may break a near-tie of this
    random model either way; comparing token lists with another bf16 backend failed on such a tie
    on the AVX-512 host, with oneDNN's bf16 GEMMs as with the small-GEMM kernel's), and most are
    the argmax. Attention accuracy itself is the conformance kit's bf16 grid."""
    name, path, _, prompts, _ = cases.get(arch)
    paged = make_engine(path, "model.dtype=bfloat16")
    assert paged.runner.kv_cache.dtype == torch.bfloat16
    calls = []
    kernel_mod = sys.modules[type(paged.runner.attn_backend).__module__]
    real = {name: getattr(kernel_mod, name) for name in ("paged_decode_attention", "paged_extend_attention")}

    def spy(name):
        return lambda *a: (calls.append((name, a[0].dtype, a[1].dtype)), real[name](*a))[1]

    for fn in real:
        setattr(kernel_mod, fn, spy(fn))
    try:
        got = run_staggered(paged, prompts)
    finally:
        for fn, impl in real.items():
            setattr(kernel_mod, fn, impl)
    # bf16 prompts stay bf16 where the extend kernel has AMX tiles for this head size
    head_dim = paged.runner.model.model.layers[0].self_attn.head_dim
    extend_q = torch.bfloat16 if kernel_mod.extend_amx_supported(head_dim) else torch.float32
    expected_calls = {("paged_extend_attention", extend_q, torch.bfloat16)}
    fused = paged.runner.model.model.fused_decoder
    fused_steps = 0 if fused is None else fused.fused_steps
    # The fused C chain takes no Qwen3 (its q/k norms), and needs bf16 linears packed with the
    # small-GEMM kernel's copies, which happens only on CPUs with native bf16 (on an AVX2-only one
    # bf16 linears stay torch's own).
    if arch.startswith("qwen3") or torch.bfloat16 not in packable_dtypes():
        assert fused_steps == 0
        expected_calls.add(("paged_decode_attention", torch.bfloat16, torch.bfloat16))
    else:  # decode steps in the fused C chain: the same decode kernel, called from C
        assert fused_steps > 0
    assert set(calls) == expected_calls
    hf = getattr(transformers, ARCHS[arch][0]).from_pretrained(path, dtype=torch.bfloat16).eval()
    argmax = 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, got, strict=True):
            logits = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
            ref = torch.log_softmax(logits, dim=-1)
            chosen = ref[torch.arange(len(out)), torch.tensor(out)]
            spacing = torch.exp2(torch.floor(torch.log2(logits.abs().max(dim=-1).values)) - 7)  # bf16: 8 bits
            assert (ref.max(dim=-1).values - chosen <= 2 * spacing).all(), (out, ref.argmax(-1).tolist())
            argmax += int((ref.argmax(-1) == torch.tensor(out)).sum())
    assert argmax >= 0.9 * sum(len(o) for o in got)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size, kv_tokens", [(1, 96), (16, 112)])
def test_retraction_keeps_greedy_output(llama, make_engine, page_size, kv_tokens, overlap):
    name, path, _, prompts, expected = llama
    # Enough KV for any one request, not for all of them decoding at once; optimistic admission.
    eng = make_engine(path, f"kv_cache.max_total_tokens={kv_tokens}", f"kv_cache.page_size={page_size}",
                      "scheduler.max_running_requests=8", f"scheduler.overlap={overlap}",
                      "scheduler.init_new_token_ratio=0.0", "scheduler.min_new_token_ratio=0.0",
                      "scheduler.retract_decode_steps=2")
    assert run_staggered(eng, prompts) == expected
    assert eng.scheduler.num_retractions > 0, "the KV budget did not force a retraction"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prompt_logprobs_match_transformers(cases, make_engine, arch):
    name, path, hf, prompts, _ = cases.get(arch)
    eng = make_engine(path)
    prompt = prompts[2]
    res = eng.generate(prompt, {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True},
                       logprob_start_len=0, top_logprobs_num=3)
    meta = res["meta_info"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    pairs = meta["input_token_logprobs"]
    assert [t for _, t in pairs] == prompt  # SGLang's [logprob, token_id] pairs
    got = [lp for lp, _ in pairs]
    assert got[0] is None and len(got) == len(prompt)
    want = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(want), atol=1e-4, rtol=0)
    top = meta["input_top_logprobs"][5]
    ref_vals, ref_ids = ref[4].topk(3)
    assert [t for _, t in top] == ref_ids.tolist()
    # output logprobs: raw log-softmax at the chosen (greedy) tokens
    first_out = meta["output_token_logprobs"][0]
    assert first_out[1] == ref[-1].argmax().item()
    assert abs(first_out[0] - ref[-1].max().item()) < 1e-4


@pytest.mark.parametrize("overlap", [False, True])
def test_max_new_tokens_zero_scores_the_prompt_without_generating(llama, make_engine, overlap):
    """SGLang's scoring use: max_new_tokens 0 with prompt logprobs runs the prefill only."""
    name, path, hf, prompts, _ = llama
    eng = make_engine(path, f"scheduler.overlap={overlap}")
    prompt = prompts[1]
    res = eng.generate(prompt, {"temperature": 0.0, "max_new_tokens": 0}, logprob_start_len=0, top_logprobs_num=2)
    assert res["output_ids"] == [] and res["text"] == ""
    assert res["meta_info"]["finish_reason"] == {"type": "length"}
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    got = [lp for lp, _ in res["meta_info"]["input_token_logprobs"]]
    want = [ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert got[0] is None
    torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(want), atol=1e-4, rtol=0)
    # Without logprobs nothing runs at all; both leave no KV behind.
    assert eng.generate(prompt, {"max_new_tokens": 0})["output_ids"] == []
    report = eng.leak_report()
    assert report["held_by_requests"] == 0 and report["leaked"] == 0, report


def test_prompt_logprobs_from_a_start_position_with_cached_prefix(llama, make_engine):
    name, path, hf, prompts, _ = llama
    eng = make_engine(path, "scheduler.chunked_prefill_size=8")
    prompt = prompts[2]
    eng.generate(prompt, {"temperature": 0.0, "max_new_tokens": 2})  # caches the prompt
    res = eng.generate(prompt, {"temperature": 0.0, "max_new_tokens": 2}, logprob_start_len=10)
    got = [lp for lp, _ in res["meta_info"]["input_token_logprobs"]]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    want = [ref[i - 1, prompt[i]].item() for i in range(10, len(prompt))]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


@pytest.mark.parametrize("overlap", [False, True])
def test_seeded_sampling_reproduces(llama, make_engine, overlap):
    name, path, _, prompts, _ = llama
    eng = make_engine(path, f"scheduler.overlap={overlap}")
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 10, "seed": 1234, "ignore_eos": True}
    alone = eng.generate(prompts[3], params)["output_ids"]
    batch = eng.generate([prompts[0], prompts[3], prompts[1]],
                         [{"temperature": 1.0, "max_new_tokens": 10}, params, {"temperature": 0.7, "max_new_tokens": 5}])
    assert batch[1]["output_ids"] == alone
    other = eng.generate(prompts[3], {**params, "seed": 99})["output_ids"]
    assert other != alone  # a different seed gives a different sample (10 tokens of a flat model)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_frees_everything(llama, make_engine, overlap):
    name, path, _, prompts, _ = llama
    eng = make_engine(path, "scheduler.chunked_prefill_size=8", f"scheduler.overlap={overlap}")
    params = {"temperature": 0.0, "max_new_tokens": 50, "ignore_eos": True}
    rids = [eng.submit(p, params) for p in prompts]
    for _ in range(4):
        eng.step()
    for rid in rids:
        assert eng.abort(rid)
    eng.step()
    assert all(eng._states[r].finished for r in rids)
    assert eng._states[rids[0]].finish_reason["type"] == "abort"
    for r in rids:
        eng._states.pop(r)


def watch_batches(register_plugin) -> list:
    """Register a plugin that records every scheduled batch's stats (``on_batch_scheduled``)."""
    from framework.hookspecs import hookimpl

    seen: list = []

    class Watch:
        @hookimpl
        def on_batch_scheduled(self, batch):
            seen.append(batch)

    register_plugin(Watch(), "watch-batches")
    return seen


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_native"])
def test_mixed_steps_run_and_keep_outputs(cases, make_engine, register_plugin, backend):
    """With ``scheduler.mixed_chunk`` the newcomers' prefill chunks share forwards with the running
    requests' decode rows (the batch hooks see ``mixed`` batches), and the tokens stay transformers'."""
    batches = watch_batches(register_plugin)
    _, path, _, prompts, expected = cases.get("llama_gqa")
    eng = make_engine(path, f"attention.backend={backend}", "scheduler.mixed_chunk=true",
                      "scheduler.mixed_chunk_min_running=1", "scheduler.chunked_prefill_size=8")
    assert run_staggered(eng, prompts) == expected
    modes = [(b.mode, b.num_running) for b in batches]
    mixed = [running for mode, running in modes if mode == "mixed"]
    assert mixed and max(mixed) >= 2, modes


def test_mixed_steps_wait_for_min_running(cases, make_engine, register_plugin):
    """``scheduler.mixed_chunk_min_running``: a prefill that finds fewer requests decoding runs
    alone; from that many on it is a mixed step, its budget ``mixed_chunk_max_tokens`` with the
    decode rows in it (not ``max_prefill_tokens``). Tokens stay transformers'."""
    stats = watch_batches(register_plugin)
    _, path, _, prompts, expected = cases.get("llama_gqa")
    eng = make_engine(path, "scheduler.mixed_chunk=true", "scheduler.mixed_chunk_min_running=3",
                      "scheduler.max_prefill_tokens=8", "scheduler.mixed_chunk_max_tokens=20",
                      "scheduler.chunked_prefill_size=8", "scheduler.mixed_chunk_max_stalled_steps=null")
    assert run_staggered(eng, prompts) == expected
    batches = [(b.mode, b.num_running, b.num_new_tokens) for b in stats]
    mixed = [(running, tokens) for mode, running, tokens in batches if mode == "mixed"]
    alone = [(running, tokens) for mode, running, tokens in batches if mode == "prefill"]
    assert mixed and alone, batches
    assert min(running for running, _ in mixed) >= 3, batches
    assert max(tokens for _, tokens in alone) <= 8 and max(tokens for _, tokens in mixed) <= 20, batches
    assert max(tokens for _, tokens in mixed) > 8, batches  # the larger budget was used


@pytest.mark.parametrize("max_stalled", [0, 1, 2, None])
def test_a_prefill_backlog_stalls_decoding_for_at_most_max_stalled_steps(cases, make_engine, register_plugin,
                                                                          max_stalled):
    """``scheduler.mixed_chunk_max_stalled_steps``: below ``mixed_chunk_min_running``, prompts
    waiting in chunks run as prefill-only steps while requests decode at most that many steps in a
    row; the next one mixes the decode rows in. null leaves only the threshold, which these
    prompts never reach: the stalls then run longer. Tokens stay transformers'."""
    stats = watch_batches(register_plugin)
    _, path, _, prompts, expected = cases.get("llama_gqa")
    setting = "null" if max_stalled is None else str(max_stalled)
    eng = make_engine(path, "scheduler.mixed_chunk=true", "scheduler.mixed_chunk_min_running=100",
                      "scheduler.max_prefill_tokens=4", "scheduler.chunked_prefill_size=4",
                      f"scheduler.mixed_chunk_max_stalled_steps={setting}")
    assert run_staggered(eng, prompts) == expected
    batches = [(b.mode, b.num_running) for b in stats]
    longest = streak = 0
    for mode, running in batches:
        streak = streak + 1 if mode == "prefill" and running > 0 else 0
        longest = max(longest, streak)
    mixed = [running for mode, running in batches if mode == "mixed"]
    if max_stalled is None:
        assert not mixed and longest > 2, batches
    else:
        assert mixed and longest == max_stalled, batches
