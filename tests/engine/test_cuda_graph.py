"""CUDA graphs for decode (framework/engine/cuda_graph_runner.py and the backends' graph hooks).

On CPU: the bucket and padding logic, the config resolution and its errors, which backends report
support, and a *simulated replay* of the torch_native graph path (static padded batch, capture and
replay hooks, the captured metadata object reused) against eager decode. The tests marked ``gpu``
capture and replay real ``torch.cuda.CUDAGraph`` objects; they are skipped without CUDA.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from framework.assets import asset_path
from framework.attention.base import Attention, AttentionBackend
from framework.config.auto import resolve_cuda_graph_enabled
from framework.config.loader import resolve_config, to_settings
from framework.errors import ConfigError
from framework.executor.cuda_graph_runner import (
    DecodeGraphInputs,
    bucket_for,
    capture_batch_sizes,
    default_batch_sizes,
    padded_seq_lens,
)
from framework.executor.forward_batch import ForwardBatch, ForwardMode
from framework.registry import Capabilities
from plugins.attention.torch_native.backend import TorchNativeAttnBackend, TorchNativeOptions
from tests.engine.harness import MiniRunner

REPO_ROOT = Path(__file__).resolve().parents[2]

# --- pure helpers -------------------------------------------------------------------------------


def test_default_batch_sizes() -> None:
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(8) == [1, 2, 4, 8]
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_batch_sizes(160)[-3:] == [144, 152, 160]


def test_capture_batch_sizes_caps_and_covers_the_running_limit() -> None:
    assert capture_batch_sizes(None, 4, 100) == [1, 2, 4]
    # The running cap cuts buckets off and becomes one, so every batch the scheduler forms fits.
    assert capture_batch_sizes([1, 2, 4, 8, 16], 160, 10) == [1, 2, 4, 8, 10]
    assert capture_batch_sizes([16, 2, 2, 1], 160, 100) == [1, 2, 16]
    assert capture_batch_sizes([1, 2, 32], 16, 100) == [1, 2, 16]
    assert capture_batch_sizes([4, 8], 160, 3) == [3]
    assert capture_batch_sizes([1, 2], 160, 2) == [1, 2]


@pytest.mark.parametrize(("n", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, None), (100, None)])
def test_bucket_for(n: int, bucket: int | None) -> None:
    assert bucket_for(n, [1, 2, 4, 8]) == bucket


def test_padded_seq_lens() -> None:
    assert padded_seq_lens([7, 3, 9], 4, 1) == [7, 3, 9, 1]
    assert padded_seq_lens([7], 1, 1) == [7]
    with pytest.raises(ValueError, match="does not fit bucket 2"):
        padded_seq_lens([1, 2, 3], 2, 1)


def _decode_batch(rows: list[int], seq_lens: list[int], slots: list[int], ids: list[int]) -> ForwardBatch:
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(
        mode=ForwardMode.DECODE, batch_size=len(rows), input_ids=t(ids), positions=t([s - 1 for s in seq_lens]),
        req_pool_indices=t(rows), seq_lens=t(seq_lens), seq_lens_cpu=seq_lens, out_cache_loc=t(slots),
        req_to_token=torch.zeros(1), kv_cache=None, attn_backend=None,  # type: ignore[arg-type]
    )  # fmt: skip


def test_static_inputs_pad_and_reset_rows_left_by_a_larger_batch() -> None:
    inputs = DecodeGraphInputs(8, torch.device("cpu"), 1, torch.zeros(1), None, None)  # type: ignore[arg-type]
    big = inputs.load(_decode_batch([5, 6, 7], [10, 11, 12], [40, 41, 42], [3, 4, 5]), 4)
    assert big.req_pool_indices.tolist() == [5, 6, 7, 0]
    small = inputs.load(_decode_batch([2], [20], [50], [9]), 4)
    assert small is big, "a bucket's static batch is one object for capture and every replay"
    assert small.input_ids.tolist() == [9, 0, 0, 0]
    assert small.positions.tolist() == [19, 0, 0, 0]
    assert small.req_pool_indices.tolist() == [2, 0, 0, 0]
    assert small.seq_lens.tolist() == [20, 1, 1, 1]
    assert small.out_cache_loc.tolist() == [50, 0, 0, 0], "padding rows must write only to padding slot 0"
    assert small.seq_lens_cpu == [20, 1, 1, 1]
    # Views of one buffer: the graph of every bucket reads the same memory.
    assert small.input_ids.data_ptr() == inputs.input_ids.data_ptr()


# --- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("enabled", "device", "supports", "expected"),
    [
        (None, "cpu", True, False),
        (False, "cpu", True, False),
        (None, "cuda", True, True),
        (None, "cuda", False, False),
        (True, "cuda", True, True),
        (False, "cuda", True, False),
    ],
)
def test_resolve_enabled(enabled: bool | None, device: str, supports: bool, expected: bool) -> None:
    assert resolve_cuda_graph_enabled(enabled, device, "x", supports) is expected


def test_enabled_without_backend_support_names_the_key_and_backend() -> None:
    with pytest.raises(ConfigError, match=r"cuda_graph.enabled: attention backend 'mine' does not support CUDA"):
        resolve_cuda_graph_enabled(True, "cuda", "mine", False)


def test_enabled_on_cpu_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"cuda_graph.enabled: CUDA graphs need a CUDA device.*'cpu'"):
        resolve_config(overrides=["device.device=cpu", "cuda_graph.enabled=true"], validate_components=False)


def test_auto_resolves_off_on_cpu() -> None:
    cfg = resolve_config(overrides=["device.device=cpu"], validate_components=False)
    assert cfg.cuda_graph.enabled is False


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("cuda_graph.max_batch_size=0", "cuda_graph.max_batch_size"),
        ("cuda_graph.batch_sizes=[1,0]", "cuda_graph.batch_sizes"),
        ("cuda_graph.batch_sizes=[]", "cuda_graph.batch_sizes"),
        ("cuda_graph.num_warmup_runs=0", "cuda_graph.num_warmup_runs"),
    ],
)
def test_bad_values_are_rejected(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        resolve_config(overrides=["device.device=cpu", override], validate_components=False)


# --- backends -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["torch_native", "triton", "flashinfer"])
def test_builtin_backends_report_support(plugins, name: str) -> None:
    assert plugins.registry.get("attention_backend", name).capabilities.cuda_graph is True


def test_base_backend_refuses_graphs_by_name() -> None:
    class NoGraphs(AttentionBackend):
        def init_forward_metadata(self, forward_batch):  # type: ignore[no-untyped-def]
            pass

        forward_extend = forward_decode = None  # type: ignore[assignment]

    backend = NoGraphs()
    assert Capabilities().cuda_graph is False  # a backend registered without declaring it
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
    for call in (
        lambda: backend.init_cuda_graph_state(4, 16),
        lambda: backend.init_forward_metadata_capture_cuda_graph(None),  # type: ignore[arg-type]
        lambda: backend.init_forward_metadata_replay_cuda_graph(None, 1),  # type: ignore[arg-type]
    ):
        with pytest.raises(NotImplementedError, match="attention backend NoGraphs does not support CUDA graphs"):
            call()


def test_model_runner_on_cpu_has_no_graph_runner(tmp_path: Path) -> None:
    from framework.executor.model_runner import ModelRunner
    from framework.testing.tiny_models import save_tiny_model

    path = save_tiny_model(tmp_path / "m")
    cfg = resolve_config(overrides=[f"model.path={path}", "device.device=cpu", "kv_cache.max_total_tokens=256"])
    assert ModelRunner(to_settings(cfg), progress=False).cuda_graph_runner is None


# --- simulated replay: the graph path of a backend against its eager decode ----------------------


def simulate_graph_decode(
    factory, options, device: str, dtype: torch.dtype, page_size: int, steps: list[list[int]], bucket_sizes: list[int]
) -> None:
    """Decode ``steps`` (each a list of request rows) once eagerly and once the way a CUDA-graph
    replay does: one static padded batch per bucket, metadata from the capture hook (on padding
    values) refreshed by the replay hook, the forward run on the bucket's rows. Without CUDA the
    forward really runs again instead of replaying, but it reads exactly what the graph would. Both
    outputs and the whole KV cache (apart from padding slot 0) must agree."""
    heads, kv_heads, head_dim = 4, 2, 64
    layer = Attention(heads, head_dim, head_dim**-0.5, kv_heads, layer_id=0)
    runs = {}
    for mode in ("eager", "graph"):
        mr = MiniRunner(factory, num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, backend_options=options,
                        dtype=dtype, page_size=page_size, num_pages=256, max_requests=8, max_context=96,
                        device=device, seed=1)  # fmt: skip
        backend = mr.attn_backend
        gen = torch.Generator().manual_seed(0)
        junk = torch.Generator().manual_seed(1)  # padding values: not drawn from ``gen``, which both runs share
        # A context per request: rows 0..5 with lengths 1..41 written straight into the cache.
        for row, length in enumerate([1, 9, 17, 33, 41, 5]):
            mr.new_request()
            slots = mr.allocator.slots(row, 0, length)
            mr.req_to_token[row, :length] = torch.tensor(slots, dtype=torch.int32)
            mr.lens[row] = length
            k = torch.randn(length, kv_heads, head_dim, generator=gen).to(device, dtype)
            mr.kv_cache.store(0, torch.tensor(slots, device=device), k, k.flip(0))
        static = None
        if mode == "graph":
            backend.init_cuda_graph_state(max(bucket_sizes), mr.req_to_token.shape[1])
            static = DecodeGraphInputs(max(bucket_sizes), mr.device, backend.get_cuda_graph_seq_len_fill_value(),
                                       mr.req_to_token, mr.kv_cache, backend)  # fmt: skip
            for bs in sorted(bucket_sizes, reverse=True):
                sfb = static.batch(bs)
                backend.init_forward_metadata_capture_cuda_graph(sfb)
                # The runner's warm-up run on the padding values (flashinfer plans here; K/V go to slot 0).
                wkv = torch.randn(bs, kv_heads * head_dim, generator=junk).to(device, dtype)
                backend.forward_decode(wkv.repeat(1, heads // kv_heads), wkv, wkv, layer, sfb)
        outs = []
        for rows in steps:
            n = len(rows)
            q = torch.randn(n, heads * head_dim, generator=gen).to(device, dtype)
            kv = torch.randn(n, kv_heads * head_dim, generator=gen).to(device, dtype)
            fb = mr.decode_batch(rows, [0] * n)  # eager metadata computed here
            if mode == "eager":
                outs.append(backend.forward_decode(q, kv, -kv, layer, fb).float().cpu())
                continue
            assert static is not None
            bs = bucket_for(n, bucket_sizes)
            assert bs is not None
            sfb = static.load(fb, bs)
            assert backend.can_replay_cuda_graph(sfb)
            backend.init_forward_metadata_replay_cuda_graph(sfb, n)
            # Padding rows carry garbage, as their dummy tokens' K/V would: wherever they land shows.
            garbage = torch.randn(bs - n, kv.shape[1], generator=junk).to(device, dtype)
            qp = torch.cat([q, garbage.repeat(1, heads // kv_heads)])
            kvp = torch.cat([kv, garbage])
            outs.append(backend.forward_decode(qp, kvp, -kvp, layer, sfb)[:n].float().cpu())
        k_buf, v_buf = mr.kv_cache.get_kv(0)
        runs[mode] = (outs, k_buf[page_size:].float().cpu(), v_buf[page_size:].float().cpu())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for step, (a, b) in enumerate(zip(runs["eager"][0], runs["graph"][0], strict=True)):
        torch.testing.assert_close(b, a, atol=tol, rtol=0, msg=lambda m, s=step: f"step {s}: {m}")
    # Padding rows wrote only into the padding page: every other slot matches the eager run.
    torch.testing.assert_close(runs["graph"][1], runs["eager"][1], atol=0, rtol=0)
    torch.testing.assert_close(runs["graph"][2], runs["eager"][2], atol=0, rtol=0)


#: Steps inside the buckets (3 pads to 4, 1, 2), a full bucket, then a smaller batch in a bucket a
#: larger one used before (its stale rows must be reset to padding).
STEPS = [[0, 1, 2], [3], [4, 5], [0, 1, 2, 3], [5, 1, 3, 0], [2, 4]]


@pytest.mark.parametrize("page_size", [1, 16])
def test_torch_native_graph_path_matches_eager_on_cpu(page_size: int) -> None:
    simulate_graph_decode(TorchNativeAttnBackend, None, "cpu", torch.float32, page_size, STEPS, [1, 2, 4])


def test_triton_graph_path_matches_eager_under_the_interpreter() -> None:
    """The same simulated replay for triton, in a subprocess: TRITON_INTERPRET must be set before
    triton is first imported (see tests/attention/triton_worker.py)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the triton package is not installed")
    code = (
        "import torch\n"
        "from plugins.attention.triton.backend import TritonAttnBackend\n"
        "from tests.engine.test_cuda_graph import STEPS, simulate_graph_decode\n"
        "for page_size in (1, 16):\n"
        "    simulate_graph_decode(TritonAttnBackend, None, 'cpu', torch.float32, page_size, STEPS, [1, 2, 4])\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=280)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_torch_native_turns_down_contexts_beyond_its_graph_buffers() -> None:
    backend = TorchNativeAttnBackend(SimpleNamespace(device="cpu"), TorchNativeOptions(cuda_graph_gather_tokens=64))
    backend.init_cuda_graph_state(4, 512)  # 64 tokens / 4 rows: contexts up to 16 replay
    fb = SimpleNamespace(seq_lens_cpu=[3, 16])
    assert backend.can_replay_cuda_graph(fb)  # type: ignore[arg-type]
    fb.seq_lens_cpu = [3, 17]
    assert not backend.can_replay_cuda_graph(fb)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="attention.options.cuda_graph_gather_tokens"):
        backend.init_cuda_graph_state(128, 512)


# --- the whole runner on CPU, with simulated graphs ---------------------------------------------


class SimulatedGraph:
    """Stands in for a ``torch.cuda.CUDAGraph``: replay runs the captured function again into the
    captured output tensor. It reads the same static buffers a real graph would."""

    def __init__(self, fn, out: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


class SimulatedGraphOps:
    """``CudaGraphOps`` without CUDA: warm-up runs, then a "capture" that runs the function once."""

    def __init__(self) -> None:
        self.captured: list[int] = []

    def free_memory(self) -> int:
        return 0

    def capture(self, fn, num_warmup_runs: int):  # type: ignore[no-untyped-def]
        for _ in range(num_warmup_runs):
            fn()
        out = fn()
        self.captured.append(out.shape[0])
        return SimulatedGraph(fn, out), out


def test_engine_with_simulated_graphs_matches_eager_on_cpu() -> None:
    """The runner end to end on CPU (buckets, padding, replay, eager fallback, model runner hook,
    scheduler), with the graph simulated: greedy outputs equal eager ones."""
    from framework import Engine
    from framework.executor.cuda_graph_runner import CudaGraphRunner

    overrides = [f"model.path={asset_path('tiny-shakespeare')}", "device.device=cpu", "kv_cache.max_total_tokens=2048",
                 "kv_cache.page_size=16", "attention.backend=torch_native"]  # fmt: skip
    engine = Engine(overrides=overrides, progress=False)
    assert engine.runner.cuda_graph_runner is None
    params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    prompts = ["ROMEO:", "To be, or not", "My lord, the king", "JULIET:\nO", "First Citizen:", "What"]
    expected = {n: [r["output_ids"] for r in engine.generate(prompts[:n], params)] for n in (1, 3, 4, 6)}

    ops = SimulatedGraphOps()
    graphs = CudaGraphRunner(engine.runner, [1, 2, 4], num_warmup_runs=1, ops=ops)  # type: ignore[arg-type]
    assert ops.captured == [4, 2, 1], "largest bucket first"
    engine.runner.cuda_graph_runner = graphs
    # 4 fills bucket 4; 3 then pads it, over rows the 4 left behind; 1 uses bucket 1.
    for n in (4, 3, 1):
        before = graphs.replay_count
        assert [r["output_ids"] for r in engine.generate(prompts[:n], params)] == expected[n], f"batch of {n}"
        assert graphs.replay_count - before == params["max_new_tokens"] - 1  # first token comes from prefill
    before = graphs.replay_count
    assert [r["output_ids"] for r in engine.generate(prompts, params)] == expected[6]
    assert graphs.replay_count == before, "6 > the largest bucket: eager"
    report = engine.leak_report()
    assert report["leaked"] == 0 and report["req_slots_free"] == report["req_slots_total"], report


# --- GPU: real capture and replay ---------------------------------------------------------------

CUDA_BACKENDS = {
    # backend -> (model dtype, module it needs)
    "torch_native": ("float32", None),
    "triton": ("float32", "triton"),
    "flashinfer": ("float16", "flashinfer"),
}


def _need(module: str | None) -> None:
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"the {module} package is not installed")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_graph_path_matches_eager_on_cuda(backend: str, page_size: int) -> None:
    from framework.plugins import get_registry

    _, module = CUDA_BACKENDS[backend]
    _need(module)
    factory = get_registry().get("attention_backend", backend).factory
    dtype = torch.float16 if backend == "flashinfer" else torch.float32
    simulate_graph_decode(factory, None, "cuda", dtype, page_size, STEPS, [1, 2, 4])


def _engine(backend: str, graphs: bool, extra: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    from framework import Engine

    dtype, module = CUDA_BACKENDS[backend]
    _need(module)
    return Engine(
        overrides=[
            f"model.path={asset_path('tiny-shakespeare')}",
            "device.device=cuda",
            f"model.dtype={dtype}",
            f"attention.backend={backend}",
            "kv_cache.max_total_tokens=8192",
            "kv_cache.page_size=16",
            f"cuda_graph.enabled={'true' if graphs else 'false'}",
            "cuda_graph.batch_sizes=[1,2,4]",
            *extra,
        ],
        progress=False,
    )


PROMPTS = ["ROMEO:", "To be, or not", "My lord, the king", "JULIET:\nO", "First Citizen:", "What", "KING"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(CUDA_BACKENDS))
def test_greedy_outputs_with_graphs_equal_eager(backend: str) -> None:
    eager = _engine(backend, graphs=False)
    assert eager.runner.cuda_graph_runner is None
    expected = {n: [r["output_ids"] for r in eager.generate(PROMPTS[:n], GREEDY)] for n in (1, 3, 4, 7)}
    del eager
    torch.cuda.empty_cache()

    engine = _engine(backend, graphs=True)
    graphs = engine.runner.cuda_graph_runner
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    for n in (1, 3, 4):  # 3 replays bucket 4 with a padding row
        before = graphs.replay_count
        got = [r["output_ids"] for r in engine.generate(PROMPTS[:n], GREEDY)]
        assert got == expected[n], f"batch of {n}"
        assert graphs.replay_count - before >= GREEDY["max_new_tokens"] - 1, "decode steps must replay"
    before = graphs.replay_count
    got = [r["output_ids"] for r in engine.generate(PROMPTS, GREEDY)]  # 7 > the largest bucket: eager
    assert got == expected[7]
    assert graphs.replay_count == before, "a batch beyond the largest bucket must run eagerly"
    report = engine.leak_report()
    assert report["leaked"] == 0 and report["req_slots_free"] == report["req_slots_total"], report


@pytest.mark.gpu
def test_auto_turns_graphs_on_with_cuda() -> None:
    cfg = resolve_config(overrides=["device.device=cuda", "attention.backend=torch_native"], validate_components=False)
    assert cfg.cuda_graph.enabled is True
