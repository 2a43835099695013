"""``model.dtype=auto``: bf16 where the CPU has native bf16 and the checkpoint is bf16, fp32
elsewhere (issue 21, item 6), and the Engine against transformers in both dtypes.

The CPU probe is injected, so these tests mean the same on any host (this project's CI hosts are
AVX2-only: bf16 there is slow but correct, hence the tiny model).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from framework import Engine
from framework.kernels.small_gemm import amx_available
from framework.models import cpu_features
from framework.models.cpu_features import cpu_has_native_bf16, flags_have_native_bf16
from framework.models.loader import resolve_dtype
from framework.testing.tiny_models import save_tiny_model


def yes() -> bool:
    return True


def no() -> bool:
    return False


@pytest.mark.parametrize(
    ("declared", "native", "want"),
    [
        (torch.bfloat16, yes, torch.bfloat16),
        ("bfloat16", yes, torch.bfloat16),
        (torch.bfloat16, no, torch.float32),
        (torch.float32, yes, torch.float32),
        (torch.float16, yes, torch.float32),  # no fast fp16 path on CPUs
        (None, yes, torch.float32),
    ],
)
def test_auto_on_cpu(declared: object, native: object, want: torch.dtype) -> None:
    assert resolve_dtype(declared, "auto", "cpu", native_bf16=native) == want


def test_an_explicit_dtype_wins() -> None:
    assert resolve_dtype(torch.bfloat16, "float32", "cpu", native_bf16=yes) == torch.float32
    assert resolve_dtype(torch.float32, "bfloat16", "cpu", native_bf16=no) == torch.bfloat16
    assert resolve_dtype(None, "float16", "cpu", native_bf16=yes) == torch.float16


def test_gpu_takes_the_checkpoint_dtype_without_asking_the_cpu() -> None:
    def fail() -> bool:
        raise AssertionError("the CPU probe is not for GPUs")

    assert resolve_dtype("bfloat16", "auto", "cuda", native_bf16=fail) == torch.bfloat16
    assert resolve_dtype(torch.float16, "auto", "cuda:0", native_bf16=fail) == torch.float16
    assert resolve_dtype(None, "auto", "cuda", native_bf16=fail) == torch.float32


def test_default_probe_is_looked_up_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_features, "cpu_has_native_bf16", yes)
    assert resolve_dtype(torch.bfloat16, "auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(cpu_features, "cpu_has_native_bf16", no)
    assert resolve_dtype(torch.bfloat16, "auto", "cpu") == torch.float32


_ZEN2 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma bmi2\nbogomips\t: 4491\n"
_ZEN4 = "flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16 avx512vbmi\n"
_SPR = "flags\t\t: fpu avx2 avx512f avx512_vnni amx_bf16 amx_tile amx_int8\n"
_SKX = "flags\t\t: fpu avx2 avx512f avx512bw avx512vl avx512dq avx512_vnni\n"  # AVX-512, no bf16
_ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes\n"


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [(_ZEN2, False), (_ZEN4, True), (_SPR, True), (_SKX, False), (_ARM, False), ("", False),
     ("flags\t: avx512_bf16_x\n", False)],
)
def test_cpuinfo_flags(cpuinfo: str, native: bool) -> None:
    assert flags_have_native_bf16(cpuinfo) is native


def test_probe_is_cached() -> None:
    cpu_has_native_bf16.cache_clear()
    first = cpu_has_native_bf16()
    assert cpu_has_native_bf16() is first and cpu_has_native_bf16.cache_info().hits == 1


# --- the Engine against transformers, in the dtype auto picks ------------------------------------

PROMPTS = [[5, 17, 42, 99, 3], [200, 7, 7, 150, 61, 33, 12, 8, 250, 1, 77]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved in bfloat16 (config dtype and weights), as most real checkpoints are."""
    path = save_tiny_model(tmp_path_factory.mktemp("fp32") / "m", "LlamaForCausalLM", seed=2)
    out = tmp_path_factory.mktemp("bf16") / "m"
    transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return out


def _engine_run(path: Path) -> tuple[Engine, list[list[int]], list[list[float]]]:
    eng = Engine(overrides=[f"model.path={path}", "kv_cache.max_total_tokens=512"], progress=False)
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    results = [eng.generate(p, params, return_logprob=True) for p in PROMPTS]
    tokens = [[tid for _, tid in r["meta_info"]["output_token_logprobs"]] for r in results]
    logprobs = [[lp for lp, _ in r["meta_info"]["output_token_logprobs"]] for r in results]
    return eng, tokens, logprobs


@torch.inference_mode()
def _hf_logprobs(hf: transformers.PreTrainedModel, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log-probabilities at each output position, the Engine's tokens fed in."""
    logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_engine_auto_bf16_matches_transformers_bf16(bf16_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a native-bf16 CPU, a bf16 checkpoint runs in bf16. Greedy tokens are compared teacher-
    forced: each token the Engine picks is transformers' bf16 argmax or within a bf16 rounding of
    it (two bf16 GEMM orders may break a near-tie differently), and its logprob is close."""
    monkeypatch.setattr(cpu_features, "cpu_has_native_bf16", yes)
    eng, tokens, logprobs = _engine_run(bf16_checkpoint)
    assert eng.runner.dtype == torch.bfloat16
    # The CPU auto budget follows the served dtype (2048 for bf16 where oneDNN has AMX tiles).
    assert eng.scheduler.cfg.max_prefill_tokens == (2048 if amx_available() else 1024)
    hf = transformers.LlamaForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.bfloat16).eval()
    exact = 0
    for prompt, out, lps in zip(PROMPTS, tokens, logprobs, strict=True):
        ref = _hf_logprobs(hf, prompt, out)
        chosen = ref[torch.arange(len(out)), torch.tensor(out)]
        assert (ref.max(dim=-1).values - chosen <= 0.1).all(), (out, ref.argmax(-1).tolist())
        torch.testing.assert_close(torch.tensor(lps), chosen, rtol=0, atol=0.1)
        exact += int((ref.argmax(-1) == torch.tensor(out)).sum())
    assert exact >= 0.9 * len(PROMPTS) * NEW_TOKENS


def test_engine_auto_fp32_without_native_bf16_matches_transformers_fp32(
    bf16_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same bf16 checkpoint on a CPU without native bf16 is served in fp32, and then greedy
    tokens equal transformers' fp32 generate exactly."""
    monkeypatch.setattr(cpu_features, "cpu_has_native_bf16", no)
    eng, tokens, _ = _engine_run(bf16_checkpoint)
    assert eng.runner.dtype == torch.float32
    assert eng.scheduler.cfg.max_prefill_tokens == 1024
    hf = transformers.LlamaForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, tokens, strict=True):
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=0, eos_token_id=None)[0, len(prompt) :].tolist()
        assert out == want


@pytest.mark.parametrize(("dtype", "budget"), [("bfloat16", 2048), ("float32", 1024)])
@pytest.mark.parametrize("amx", [True, False])
def test_cpu_prefill_budget_follows_the_served_dtype_unless_set(tiny_model: Path, dtype: str, budget: int, amx: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``scheduler.max_prefill_tokens: null`` on CPU: 2048 for weights served in bf16 where oneDNN
    has AMX tiles, 1024 otherwise, resolved once the dtype is known; a value the user sets is kept
    as it is. (The AMX probe is injected: the budget is a choice, the engine runs either way.)"""
    import framework.scheduler.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "amx_available", lambda: amx)
    budget = budget if amx else 1024
    base = [f"model.path={tiny_model}", f"model.dtype={dtype}", "kv_cache.max_total_tokens=512"]
    eng = Engine(overrides=base, progress=False)
    assert eng.scheduler.cfg.max_prefill_tokens == eng.scheduler.planner.cfg.max_prefill_tokens == budget
    eng.close()
    eng = Engine(overrides=[*base, "scheduler.max_prefill_tokens=300"], progress=False)
    assert eng.scheduler.cfg.max_prefill_tokens == 300
    eng.close()
