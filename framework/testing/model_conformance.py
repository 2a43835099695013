"""A conformance kit for model plugins (``register_models``): plugserve's Engine against
transformers on a tiny random checkpoint of a config the author gives.

A model author runs it from their own test suite::

    import transformers
    from framework.testing.model_conformance import assert_conformant

    def test_my_model_conforms():
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)
        assert_conformant("MyLlamaForCausalLM", config)  # or the factory: assert_conformant(MyModel.create, config)

The kit builds the transformers model of the config (``AutoModelForCausalLM.from_config``, or
``hf_model_cls``), gives every parameter random values (norm weights around 1, biases too, so a
weight loaded into the wrong place shows), saves it with a locally trained tokenizer
(:func:`framework.testing.tiny_models.build_tokenizer`), loads that directory through plugserve's
:class:`~framework.Engine` with ``model.architecture`` set to the plugin's name (one thread, a
small KV cache, chunked prefill smaller than the longest prompt), and checks:

- ``load``: the Engine builds (``load_weights`` takes every tensor of the checkpoint);
- ``reference``: transformers' log-probs are spread out (std > 0.5) and its greedy continuations
  differ across prompts, so the comparisons below can tell models apart (a failure here is a
  config the kit cannot use, e.g. a vocabulary of 2);
- ``prompt_logprobs``: each prompt's ``input_token_logprobs`` (``logprob_start_len=0``) within
  ``atol`` of transformers' log-softmax, one prompt at a time;
- ``greedy_batch``: greedy tokens of all prompts in one batch (mixed lengths, chunked prefill)
  equal transformers' ``generate``;
- ``greedy_cached_prefix``: prompts that extend ones already served (radix-cache hits: the model
  runs on top of a cached prefix at non-zero positions) equal transformers' too.

A greedy divergence where transformers' top two logits are within ``tie_tolerance`` is a tie, not
a failure: the comparison of that prompt stops there and the report says so.
"""

from __future__ import annotations

import copy
import itertools
import random
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from framework.testing.conformance_common import (
    CheckFailed,
    CheckResult,
    ConformanceReport,
    display_name,
    run_check,
)
from framework.testing.tiny_models import build_tokenizer

__all__ = ["CHECKS", "CheckResult", "ConformanceReport", "assert_conformant", "run_conformance"]

CHECKS = ("load", "reference", "prompt_logprobs", "greedy_batch", "greedy_cached_prefix")
DEFAULT_ATOL = 1e-4
PROMPT_LENS = (3, 11, 24, 37)
_temp_names = itertools.count()


def randomize_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random and distinct: norm weights in [0.5, 1.5], embeddings N(0, 0.5),
    the rest (biases too) N(0, 0.15), so loading bugs (a swapped, transposed or skipped tensor)
    change the logits. The same recipe as ``tests/engine/test_models_vs_hf.py``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                values = torch.rand(param.shape, generator=gen) + 0.5
            else:
                values = torch.randn(param.shape, generator=gen) * (0.5 if "embed" in name else 0.15)
            param.copy_(values.to(param.dtype))


def save_checkpoint(hf_config: Any, path: Path, seed: int = 0, hf_model_cls: Any = None) -> tuple[Any, Any]:
    """Build the transformers model of ``hf_config`` with random weights, save it and a tokenizer to
    ``path``; return ``(model, tokenizer)``. The vocabulary grows to the tokenizer's if smaller."""
    import transformers

    tokenizer = build_tokenizer()
    config = copy.deepcopy(hf_config)
    config.vocab_size = max(int(config.vocab_size), len(tokenizer))
    torch.manual_seed(seed)
    cls = hf_model_cls or transformers.AutoModelForCausalLM
    model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    model = model.to(torch.float32).eval()
    randomize_weights(model, seed)
    model.generation_config.eos_token_id = None  # exactly max_new_tokens, like ignore_eos
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def default_prompts(vocab_size: int, seed: int = 1) -> list[list[int]]:
    """Prompts of mixed lengths (3 .. 37 tokens) over the whole vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENS]


@dataclass
class _Reference:
    log_probs: list[torch.Tensor]
    """Per prompt, transformers' log-softmax over the prompt positions ``[len, vocab]``."""
    greedy: list[list[int]]
    scores: list[list[torch.Tensor]]
    """Per prompt, transformers' logits at each generated step (for tie detection)."""


@torch.inference_mode()
def _reference(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> _Reference:
    log_probs, greedy, scores = [], [], []
    for p in prompts:
        ids = torch.tensor([list(p)])
        log_probs.append(torch.log_softmax(model(ids).logits[0].float(), dim=-1))
        # An explicit all-ones mask: otherwise transformers masks prompt tokens equal to pad_token_id.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             eos_token_id=None, pad_token_id=0)
        greedy.append(out.sequences[0, len(p):].tolist())
        scores.append([s[0].float() for s in out.scores])
    return _Reference(log_probs, greedy, scores)


def _compare_greedy(label: str, got: list[int], want: list[int], scores: list[torch.Tensor],
                    tie_tolerance: float) -> str | None:
    """None when equal; a note when they part at a tie; raises CheckFailed otherwise."""
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g == w:
            continue
        gap = float(scores[i][w] - scores[i][g]) if g < scores[i].numel() else float("inf")
        if gap <= tie_tolerance:
            return f"{label}: parts from transformers at step {i} on a tie (logit gap {gap:.2g})"
        raise CheckFailed(f"{label}: greedy token {i} is {g}, transformers' is {w} (logit gap {gap:.3g}); "
                          f"got {got}, expected {want}")
    if len(got) != len(want):
        raise CheckFailed(f"{label}: {len(got)} tokens generated, expected {len(want)}")
    return None


class _TempModelPlugin:
    """Registers a model factory under a temporary name for one run."""

    def __init__(self, name: str, factory: Callable[..., Any], options_cls: type | None) -> None:
        from framework.hookspecs import hookimpl

        @hookimpl
        def register_models(register: Any) -> None:
            register(name, factory, config=options_cls)

        self.register_models = register_models


def run_conformance(
    architecture: str | Callable[..., Any],
    hf_config: Any,
    options: Mapping[str, Any] | None = None,
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    max_new_tokens: int = 8,
    atol: float = DEFAULT_ATOL,
    tie_tolerance: float | None = None,
    engine_overrides: Sequence[str] = (),
    hf_model_cls: Any = None,
    options_cls: type | None = None,
    work_dir: str | Path | None = None,
    seed: int = 0,
) -> ConformanceReport:
    """Check a model plugin against transformers on a random checkpoint of ``hf_config``.

    ``architecture`` is the registered model name (what ``model.architecture`` selects) or the
    factory itself (``factory(hf_config, options) -> nn.Module``; registered under a temporary
    name for the run, with ``options_cls`` as its options dataclass). ``options`` is the
    ``model.options`` mapping. ``hf_config`` is a transformers config (``LlamaConfig(...)``); the
    reference is ``AutoModelForCausalLM.from_config(hf_config)`` unless ``hf_model_cls`` is given.
    ``engine_overrides`` are extra config dotlist entries (``attention.backend=torch_native``,
    ``device.device=cuda``). The checkpoint is written to ``work_dir`` (a temporary directory
    by default, removed afterwards)."""
    tie = 10 * atol if tie_tolerance is None else tie_tolerance
    if isinstance(architecture, str):
        name, plugin = architecture, None
    else:
        name = f"conformance_model_{next(_temp_names)}"
        plugin = _TempModelPlugin(name, architecture, options_cls)
    display = architecture if isinstance(architecture, str) else display_name(architecture)
    report = ConformanceReport("model", f"{display} ({type(hf_config).__name__})")
    threads = torch.get_num_threads()
    tmp = tempfile.TemporaryDirectory(prefix="plugserve-model-conformance-") if work_dir is None else None
    path = Path(tmp.name if tmp is not None else work_dir)
    from framework.plugins import get_plugins

    plugins = get_plugins()
    plugin_name = None
    try:
        if plugin is not None:
            plugin_name = plugins.register(plugin, name=f"{name}-plugin")
        _run(report, name, hf_config, options, prompts, max_new_tokens, atol, tie, engine_overrides,
             hf_model_cls, path, seed)
    finally:
        torch.set_num_threads(threads)
        if plugin_name is not None:
            plugins.unregister(plugin_name)
        if tmp is not None:
            tmp.cleanup()
    return report


def _run(report: ConformanceReport, name: str, hf_config: Any, options: Mapping[str, Any] | None,
         prompts: Sequence[Sequence[int]] | None, max_new_tokens: int, atol: float, tie: float,
         engine_overrides: Sequence[str], hf_model_cls: Any, path: Path, seed: int) -> None:
    from framework import Engine

    state: dict[str, Any] = {}

    def load() -> str:
        hf, _tok = save_checkpoint(hf_config, path, seed, hf_model_cls)
        vocab = int(hf.config.vocab_size)
        ps = [list(p) for p in prompts] if prompts is not None else default_prompts(vocab, seed + 1)
        longest = max(len(p) for p in ps)
        overrides = [
            f"model.path={path}", f"model.architecture={name}", "device.num_threads=1",
            f"kv_cache.max_total_tokens={max(512, 4 * (longest + max_new_tokens) * len(ps))}",
            f"scheduler.chunked_prefill_size={max(8, longest // 2)}",
            *(f"model.options.{k}={v}" for k, v in (options or {}).items()),
            *engine_overrides,
        ]
        state.update(hf=hf, prompts=ps, engine=Engine(overrides=overrides, progress=False))
        state["ref"] = _reference(hf, ps, max_new_tokens)
        return f"{sum(p.numel() for p in hf.parameters())} parameters, vocab {vocab}, prompts of {[len(p) for p in ps]}"

    def needs_load(fn: Callable[[], str]) -> Callable[[], str]:
        def wrapped() -> str:
            if "engine" not in state:
                raise CheckFailed("not run: the model did not load")
            return fn()
        return wrapped

    def reference() -> str:
        ref: _Reference = state["ref"]
        std = min(float(lp.std()) for lp in ref.log_probs)
        if std <= 0.5:
            raise CheckFailed(f"transformers' log-probs are nearly flat (std {std:.3g}): comparisons could not "
                              "tell models apart; use a config with a larger hidden size or vocabulary")
        distinct = len({tuple(g) for g in ref.greedy})
        if len(ref.greedy) > 1 and distinct == 1:
            raise CheckFailed("transformers' greedy continuations are the same for every prompt")
        return f"log-prob std >= {std:.3g}, {distinct} distinct continuations"

    def prompt_logprobs() -> str:
        eng, ref, worst = state["engine"], state["ref"], 0.0
        for i, p in enumerate(state["prompts"]):
            res = eng.generate(p, {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True},
                               logprob_start_len=0)
            pairs = res["meta_info"]["input_token_logprobs"]
            if [t for _, t in pairs] != p:
                raise CheckFailed(f"prompt {i}: input_token_logprobs name {[t for _, t in pairs]}, not the prompt")
            want = torch.tensor([float(ref.log_probs[i][j - 1, p[j]]) for j in range(1, len(p))])
            got = torch.tensor([float(lp) for lp, _ in pairs[1:]])
            err = float((got - want).abs().max()) if len(p) > 1 else 0.0
            worst = max(worst, err)
            if not err <= atol:  # NaN fails too
                j = int((got - want).abs().argmax()) + 1
                raise CheckFailed(f"prompt {i} ({len(p)} tokens): logprob of token {j} is {float(got[j - 1]):.6g}, "
                                  f"transformers' {float(want[j - 1]):.6g} (max abs err {err:.3g} > atol {atol:g})")
        return f"max abs err {worst:.3g} (atol {atol:g})"

    def greedy(label: str, ps: list[list[int]], want: list[list[int]], scores: list[list[torch.Tensor]]) -> str:
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        results = state["engine"].generate(ps, [params] * len(ps))
        notes = [n for i, r in enumerate(results)
                 if (n := _compare_greedy(f"{label} prompt {i}", r["output_ids"], want[i], scores[i], tie))]
        return f"{len(ps)} prompts x {max_new_tokens} tokens equal" + ("; " + "; ".join(notes) if notes else "")

    def greedy_batch() -> str:
        ref = state["ref"]
        return greedy("batch", state["prompts"], ref.greedy, ref.scores)

    def greedy_cached_prefix() -> str:
        eng, hf, ps = state["engine"], state["hf"], state["prompts"]
        params = {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True}
        eng.generate(ps, [params] * len(ps))  # cache the prompts (already cached unless a check failed)
        rng = random.Random(seed + 2)
        vocab = int(hf.config.vocab_size)
        longer = [p + [rng.randrange(vocab) for _ in range(5 + 3 * i)] for i, p in enumerate(ps)]
        before = getattr(eng.scheduler, "cache_hit_tokens", None)
        ref = _reference(hf, longer, max_new_tokens)
        detail = greedy("cached-prefix", longer, ref.greedy, ref.scores)
        if before is None:
            return detail + "; prefix-cache hits not measurable (no Scheduler.cache_hit_tokens)"
        hits = eng.scheduler.cache_hit_tokens - before
        if hits <= 0:
            raise CheckFailed("the longer prompts did not hit the prefix cache: nothing was checked on top of a prefix")
        return f"{detail}; {hits} cached tokens reused"

    fns = {"load": load, "reference": needs_load(reference), "prompt_logprobs": needs_load(prompt_logprobs),
           "greedy_batch": needs_load(greedy_batch), "greedy_cached_prefix": needs_load(greedy_cached_prefix)}
    for check in CHECKS:
        report.results.append(run_check(check, fns[check]))
    eng = state.get("engine")
    if eng is not None:
        leaks = eng.leak_report()
        if leaks.get("leaked", 0) or leaks.get("req_slots_free") != leaks.get("req_slots_total"):
            report.results.append(CheckResult("engine_idle", False, f"KV or request rows leaked: {leaks}"))


def assert_conformant(architecture: str | Callable[..., Any], hf_config: Any,
                      options: Mapping[str, Any] | None = None, **kwargs: Any) -> ConformanceReport:
    """:func:`run_conformance`, raising ``AssertionError`` with every failing check if any fails."""
    return run_conformance(architecture, hf_config, options, **kwargs).raise_for_failures()
