"""The fused decode step (``framework.models.fused_decode``): all decoder layers of a decode step
in one C call must give the module path's logits bit for bit, run only where it can, and notice
when the modules it points into change.

The end-to-end greedy comparison with transformers runs through it too
(``test_engine_vs_hf.py::test_greedy_equals_transformers`` asserts that it ran).
"""

from __future__ import annotations

import pytest
import torch

from framework.kernels import decode_layers, small_gemm
from framework.models.cpu_linear import pack_linear_layers, packable_dtypes, unpack_linear_layers
from framework.testing.tiny_models import save_tiny_model

pytestmark = pytest.mark.skipif(not small_gemm.kernel_available() or decode_layers.kernels(torch.float32) is None,
                                reason="needs a C compiler for the kernels")

BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    torch.bfloat16 not in packable_dtypes(), reason="bf16 linears are packed only on CPUs with native bf16"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made: dict[str, object] = {}

    def get(name: str):
        if name not in made:
            arch, cfg = {"llama": ("LlamaForCausalLM", {}), "qwen2": ("Qwen2ForCausalLM", {}),
                         "llama_tied_mha": ("LlamaForCausalLM", dict(tie_word_embeddings=True,
                                                                     num_key_value_heads=4)),
                         "qwen3": ("Qwen3ForCausalLM", dict(head_dim=32))}[name]
            made[name] = save_tiny_model(tmp_path_factory.mktemp(name), arch, **cfg)
        return made[name]

    return get


def decode_batch(eng, n_requests: int, seed: int = 0, new_tokens: int = 6):
    """Prefill ``n_requests`` prompts of different lengths, then run one decode step and return its
    ForwardBatch (the requests keep running: the caller finishes them)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = eng.runner.vocab_size
    rids = [eng.submit(torch.randint(0, vocab, (5 + 7 * i,), generator=gen).tolist(),
                       {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True})
            for i in range(n_requests)]
    sched, runner = eng.scheduler, eng.runner
    while sched.waiting or sched.chunked:
        eng.step()
    captured = []
    forward = runner.forward

    def capture(batch):
        captured.append(batch)
        return forward(batch)

    runner.forward = capture
    try:
        eng.step()
    finally:
        runner.forward = forward
    assert captured and captured[-1].mode.is_decode() and captured[-1].batch_size == n_requests
    return captured[-1], rids


def fused_and_modules(eng, batch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Logits of ``batch`` fused, then through the modules (both store the same K/V), and how many
    forwards the fused decoder took."""
    stack = eng.runner.model.model
    fused = stack.fused_decoder
    before = fused.fused_steps
    a = eng.runner.forward(batch)
    stack.fused_decoder = None
    try:
        b = eng.runner.forward(batch)
    finally:
        stack.fused_decoder = fused
    return a, b, fused.fused_steps - before


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("name", ["llama", "qwen2", "llama_tied_mha"])
@pytest.mark.parametrize("rows", [1, 5])
def test_fused_step_equals_the_modules_bitwise(engine_factory, models, name, dtype, rows, monkeypatch):
    """GQA and MHA, qkv biases (Qwen2), a tied lm_head; one and several rows of different lengths.
    The modules run the kernel at these rows too (with AMX bf16 linears of more than
    ``AMX_BF16_MAX_ROWS`` rows would go to oneDNN, which sums in another order)."""
    limit = small_gemm.max_rows(dtype)
    monkeypatch.setattr(small_gemm, "max_rows", lambda dtype=torch.float32: max(rows, limit))
    eng = engine_factory(models(name), f"model.dtype={str(dtype).removeprefix('torch.')}")
    assert eng.runner.fused_decode and eng.runner.describe()["cpu_fused_decode"] is True
    batch, rids = decode_batch(eng, rows)
    fused, modules, taken = fused_and_modules(eng, batch)
    assert taken == 1
    assert fused.dtype == torch.float32 and fused.shape == modules.shape
    assert torch.equal(fused, modules)
    eng.run_until_done(rids)


def assert_within_rounding(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Logits of the same step through GEMMs that sum in different orders."""
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    else:
        # Two bf16 GEMMs that sum in different orders round some outputs a bf16 step apart, and each
        # layer's rounding feeds the next: allow two bf16 steps at the logits' scale on average and
        # sixteen at most (on the AMX host, 14 rows, oneDNN vs the kernel measured 0.70 at most and
        # 0.05 on average against a step of 0.0625; a wrong result differs by whole logits).
        step = 2.0 ** (torch.floor(torch.log2(b.abs().max())).item() - 7)
        diff = (a - b).abs()
        assert diff.mean().item() <= 2 * step and diff.max().item() <= 16 * step


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_steps_up_to_the_fused_row_limit_are_fused(engine_factory, models, dtype, monkeypatch):
    """At ``fused_max_rows`` rows the step is fused: within rounding of the modules on oneDNN,
    bitwise what the modules give when they run the same kernel at those rows, and one row past the
    limit runs the modules. On AVX-512 builds those rows are past ``max_rows`` (where a linear
    alone goes to oneDNN); on AVX2 ones (fp32: 64 fused and alone) the row blocks are the kernel's
    half-panel tiles."""
    rows = small_gemm.fused_max_rows(dtype)
    eng = engine_factory(models("llama"), f"model.dtype={str(dtype).removeprefix('torch.')}",
                         "kv_cache.max_total_tokens=16384")
    batch, rids = decode_batch(eng, rows, new_tokens=16)
    # The modules on oneDNN: no linear of these rows goes to the kernel.
    monkeypatch.setattr(small_gemm, "max_rows", lambda dtype=torch.float32: 0)
    fused, onednn, taken = fused_and_modules(eng, batch)
    assert taken == 1
    assert_within_rounding(fused, onednn, dtype)
    # The module path with the kernel at these rows: bit for bit. The LM head (outside the fused
    # layers) takes the kernel too, where above it ran on oneDNN: on a CPU with AMX oneDNN's bf16
    # GEMM sums in another order, so those logits are compared closely, not bitwise.
    monkeypatch.setattr(small_gemm, "max_rows", lambda dtype=torch.float32: rows)
    fused_again, kernel_modules, _ = fused_and_modules(eng, batch)
    assert torch.equal(fused_again, kernel_modules)
    assert_within_rounding(fused_again, fused, dtype)
    # One row more than it takes: the modules run.
    monkeypatch.setattr(small_gemm, "fused_max_rows", lambda dtype=torch.float32: rows - 1)
    _, _, taken = fused_and_modules(eng, batch)
    assert taken == 0
    monkeypatch.undo()
    eng.run_until_done(rids)


def test_every_decode_step_of_a_run_is_fused(engine_factory, models):
    eng = engine_factory(models("llama"))
    batch, rids = decode_batch(eng, 3)
    eng.run_until_done(rids)
    # 6 new tokens: the first from the prefill, then 5 decode steps (one captured above).
    assert eng.runner.model.model.fused_decoder.fused_steps == 5


def test_qwen3_qk_norms_run_the_modules(engine_factory, models):
    """Qwen3 normalises q and k per head before RoPE, which the C chain does not: never fused."""
    eng = engine_factory(models("qwen3"))
    batch, rids = decode_batch(eng, 2)
    _, _, taken = fused_and_modules(eng, batch)
    assert taken == 0 and eng.runner.model.model.fused_decoder.plan(eng.runner.model.model.layers) is None
    eng.run_until_done(rids)


def test_a_backend_without_native_decode_runs_the_modules(engine_factory, models):
    eng = engine_factory(models("llama"), "attention.backend=torch_native")
    batch, rids = decode_batch(eng, 2)
    _, _, taken = fused_and_modules(eng, batch)
    assert taken == 0
    eng.run_until_done(rids)


def test_rows_above_the_fused_limit_run_the_modules(engine_factory, models, monkeypatch):
    eng = engine_factory(models("llama"))
    batch, rids = decode_batch(eng, 3)
    monkeypatch.setattr(small_gemm, "fused_max_rows", lambda dtype=torch.float32: 2)
    _, _, taken = fused_and_modules(eng, batch)
    assert taken == 0
    monkeypatch.undo()
    _, _, taken = fused_and_modules(eng, batch)
    assert taken == 1
    eng.run_until_done(rids)


def test_switched_off_by_config_and_with_onednn_alone(engine_factory, models):
    for override in ("device.cpu_fused_decode=false", "device.cpu_small_gemm=onednn"):
        eng = engine_factory(models("llama"), override)
        assert eng.runner.fused_decode is False and eng.runner.model.model.fused_decoder is None
        assert eng.runner.describe()["cpu_fused_decode"] is False


def test_repacked_weights_rebuild_the_plan(engine_factory, models):
    """A weight update unpacks and repacks the linears (new modules, new weight copies): the plan
    must follow, or the C chain would read freed memory."""
    eng = engine_factory(models("llama"))
    batch, rids = decode_batch(eng, 2)
    model, decoder = eng.runner.model, eng.runner.model.model.fused_decoder
    old_plan = decoder.plan(model.model.layers)
    unpack_linear_layers(model)
    assert decoder.plan(model.model.layers) is None  # plain nn.Linear layers: the modules run
    _, _, taken = fused_and_modules(eng, batch)
    assert taken == 0
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.mul_(0.5)  # a visible change
    pack_linear_layers(model, small_gemm=True)
    new_plan = decoder.plan(model.model.layers)
    assert new_plan is not None and new_plan is not old_plan
    fused, modules, taken = fused_and_modules(eng, batch)
    assert taken == 1 and torch.equal(fused, modules)
    eng.run_until_done(rids)


def test_a_failing_kernel_is_reported_with_its_layer_and_stage(engine_factory, models):
    """More rows than the small-GEMM kernel takes: the qkv GEMM of layer 0 refuses (the norm before
    it does not), and the error says so instead of returning garbage."""
    eng = engine_factory(models("llama"))
    plan = eng.runner.model.model.fused_decoder.plan(eng.runner.model.model.layers)
    rows, shape = small_gemm.MAX_ROWS + 1, plan.shape
    width = (shape["heads"] + 2 * shape["kv_heads"]) * shape["head_dim"]
    big = torch.zeros(rows, max(width, shape["intermediate"], shape["hidden"]))
    step = decode_layers.DecodeStep(rows, shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"],
                                    shape["intermediate"], shape["head_dim"], 1, 0, *([big.data_ptr()] * 12),
                                    shape["head_dim"], None, None)
    with pytest.raises(RuntimeError, match="qkv projection kernel of layer 0 failed"):
        decode_layers.run(decode_layers.kernels(torch.float32), plan.weights, step)
