"""``device.cpu_gemm_warmup``: oneDNN's GEMM primitives are built before the first request needs them.

What "built" means is read from oneDNN itself: with ``torch.backends.mkldnn.verbose`` on creation,
oneDNN prints a ``create:cache_miss`` line for every primitive it JIT-compiles (``cache_hit`` for one
it reuses), so a step that meets an unwarmed row count shows up without timing anything.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from framework.kernels import small_gemm
from framework.models.cpu_linear import PackedLinear, onednn_linear_available, packable_dtypes
from framework.models.gemm_warmup import GemmWarmup, distinct_layers, reaches_onednn, row_buckets, warm_packed_gemms
from framework.models.onednn_rows import bucket_rows

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear ops")

# Three prompts whose prefill (one step, 3 x 70 = 210 rows) reaches a bucket (224) that neither the
# engine's start nor a one-prompt request touches; then four decode steps of 3 rows.
PROMPTS = [[(7 * i + j) % 300 + 5 for j in range(70)] for i in range(3)]

# Each engine runs in a process of its own: oneDNN's primitive cache is the whole process's, so
# whatever ran before in this one (the control engine, other tests) would have built them already.
_RUN = """
import ctypes, json, sys
import torch
from framework.engine.engine import Engine

model, dtype, warm, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
engine = Engine(overrides=[f"model.path={model}", f"model.dtype={dtype}", "device.cpu_linear=onednn",
                           f"device.cpu_gemm_warmup={warm}"], progress=False)
libc = ctypes.CDLL(None)
libc.fflush(None)
print("@@start", flush=True)
with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
    outs = engine.generate(prompts, {"max_new_tokens": 4, "temperature": 0.0})
libc.fflush(None)  # oneDNN prints through C's stdio, which buffers a pipe by blocks
print("@@end", flush=True)
print("@@result " + json.dumps({"outputs": [o["output_ids"] for o in outs],
                                "warmup": engine.runner.describe()["cpu_gemm_warmup"]}), flush=True)
"""


def _primitives_built(model: Path, dtype: str, warm: bool) -> tuple[dict, list[str]]:
    """The engine's warm-up report and greedy outputs of PROMPTS, and the oneDNN primitives it
    built while computing them (each ``create:cache_miss`` line)."""
    proc = subprocess.run([sys.executable, "-c", _RUN, str(model), dtype, str(warm).lower(), json.dumps(PROMPTS)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    during = out[out.index("@@start"):out.index("@@end")].splitlines()
    result = json.loads(out[out.index("@@result ") + len("@@result "):].splitlines()[0])
    return result, [ln for ln in during if "create:cache_miss" in ln]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_warmed_engine_builds_no_primitive_at_a_new_row_count(tiny_model: Path, dtype: str) -> None:
    if getattr(torch, dtype) not in packable_dtypes():
        pytest.skip(f"oneDNN packs no {dtype} linears on this CPU (no native bf16 dot products)")
    cold, cold_built = _primitives_built(tiny_model, dtype, warm=False)
    assert cold["warmup"] is None
    # The control: unwarmed, the same requests make oneDNN build primitives (so this test can fail).
    assert cold_built, "the unwarmed engine built no primitive: the prompts no longer reach a new row count"

    warm, warm_built = _primitives_built(tiny_model, dtype, warm=True)
    assert warm["warmup"]["layers"] == 5 and warm["warmup"]["complete"]
    assert warm["warmup"]["max_rows"] >= sum(map(len, PROMPTS))
    assert warm_built == [], f"{len(warm_built)} primitive(s) built after the warm-up, e.g. {warm_built[0][:300]}"
    assert warm["outputs"] == cold["outputs"]  # the warm-up changes no result


def test_row_buckets_cover_every_row_count() -> None:
    buckets = row_buckets(1792)
    assert buckets == sorted(set(buckets)) and buckets[-1] == bucket_rows(1792)
    assert all(bucket_rows(rows) in buckets for rows in range(1, 1793))
    assert len(buckets) < 100  # bounded: the point of bucketing (and the warm-up's cost)


def test_distinct_layers_follow_the_declared_calls() -> None:
    """Layers of one shape share primitives: one of each is called, with how the model calls it
    (``gemm_call``), and an unknown call is an error naming the allowed ones."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16))
    model[2].gemm_call = "add"
    packed = nn.Sequential(*(PackedLinear(m) for m in model))
    layers = distinct_layers(packed)
    assert [(m.in_features, m.out_features, call) for m, call in layers] == [(16, 32, "plain"), (32, 16, "add")]
    model[2].gemm_call = "residual"
    with pytest.raises(ValueError, match="plain, add, logits"):
        distinct_layers(nn.Sequential(PackedLinear(model[2])))


def test_the_warm_up_runs_no_collective() -> None:
    """A tensor-parallel layer's collective (``output_op``) is skipped while warming, since each
    rank warms on its own, and is back afterwards."""
    calls: list[int] = []

    def collective(y: torch.Tensor) -> torch.Tensor:
        calls.append(y.shape[0])
        return y

    linear = nn.Linear(16, 8)
    linear.gemm_call = "add"
    packed = PackedLinear(linear)
    packed.output_op = collective
    done = warm_packed_gemms(packed, max_rows=100, max_logits_rows=4)
    assert isinstance(done, GemmWarmup) and done.layers == 1 and done.calls == len(row_buckets(100))
    assert calls == [] and packed.output_op is collective
    x = torch.randn(3, 16)
    packed.forward_add(x, torch.zeros(3, 8))
    assert calls == [3]


def test_only_the_row_counts_that_reach_onednn_are_warmed(capfd: pytest.CaptureFixture[str]) -> None:
    """``reaches_onednn`` agrees with the layer's own dispatch: a first call at a bucket builds a
    primitive exactly when it says oneDNN runs it (the small-GEMM kernel takes the small ones). The
    shape is this test's own, so no other test has built its primitives in this process."""
    if not small_gemm.kernel_available():
        pytest.skip("the small-GEMM kernel does not build here, so every row count reaches oneDNN")
    libc = ctypes.CDLL(None)
    packed = PackedLinear(nn.Linear(40, 72), small_gemm=True)
    limit = small_gemm.max_rows(torch.float32)
    for rows in sorted({1, 2, limit, bucket_rows(limit + 1), 300}):
        libc.fflush(None)
        capfd.readouterr()
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
            packed(torch.randn(rows, 40))
        libc.fflush(None)
        built = "create:cache_miss" in capfd.readouterr().out
        assert built == reaches_onednn(packed, rows), f"{rows} rows: built {built}"
    assert not reaches_onednn(packed, 1) and reaches_onednn(packed, 300)


def test_the_warm_up_stops_at_its_time_budget() -> None:
    packed = PackedLinear(nn.Linear(16, 8))
    spent = warm_packed_gemms(packed, max_rows=500, max_logits_rows=4, max_seconds=1e-9)
    assert not spent.complete and spent.calls == 0 and spent.max_rows == 0
    whole = warm_packed_gemms(packed, max_rows=500, max_logits_rows=4)
    assert whole.complete and whole.max_rows == bucket_rows(500) and whole.calls == len(row_buckets(500))
