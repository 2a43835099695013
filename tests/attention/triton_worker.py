"""Runs triton-backend checks in a fresh process under Triton's interpreter (CPU machines).

``TRITON_INTERPRET`` must be set before triton is first imported (its standard-library functions are
decorated then), which a pytest process that already imported triton cannot undo; so the CPU tests
run this script in a subprocess and read its JSON answer from the last line of stdout.

    python -m tests.attention.triton_worker conformance CASE_ID [CASE_ID ...]
    python -m tests.attention.triton_worker generate MODEL_DIR
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # as a script only: on a GPU the tests import generate() in-process
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_case(case_id: str):
    """Inverse of ``str(ConformanceCase)``: ``prefix-page16-h8kv2-d64-float32``."""
    from framework.testing.attention_conformance import ConformanceCase

    scenario, page, heads, dim, dtype = case_id.split("-")
    h, hkv = heads.removeprefix("h").split("kv")
    return ConformanceCase(scenario, int(page.removeprefix("page")), int(h), int(hkv), int(dim[1:]), DTYPES[dtype])


def conformance(case_ids: list[str]) -> list[dict]:
    from framework.testing.attention_conformance import run_conformance

    report = run_conformance("triton", cases=[parse_case(c) for c in case_ids])
    return [dict(case=str(r.case), passed=r.passed, line=str(r), error=r.error) for r in report.results]


def generate(model_dir: str, device: str = "cpu") -> dict[str, list[list[int]]]:
    """Greedy outputs of torch_native and triton on the same prompts (pages of 16, chunked prefill,
    a prompt that arrives after its prefix is cached)."""
    from framework import Engine

    prompts = [[5, 9, 17, 3, 8], list(range(20, 41)), list(range(20, 41)) + [7, 1, 2]]
    params = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
    outputs: dict[str, list[list[int]]] = {}
    for backend in ("torch_native", "triton"):
        eng = Engine(
            overrides=[
                f"model.path={model_dir}",
                f"device.device={device}",
                "model.dtype=float32",
                "kv_cache.max_total_tokens=512",
                "kv_cache.page_size=16",
                "scheduler.chunked_prefill_size=8",
                f"attention.backend={backend}",
            ],
            progress=False,
        )
        assert (
            type(eng.runner.attn_backend).__name__
            == {"torch_native": "TorchNativeAttnBackend", "triton": "TritonAttnBackend"}[backend]
        )
        first = eng.generate(prompts[:2], params)
        second = eng.generate(prompts[2], params)  # arrives after prompt 1 is cached: a radix hit
        assert eng.scheduler.cache_hit_tokens > 0
        outputs[backend] = [r["output_ids"] for r in first] + [second["output_ids"]]
    return outputs


if __name__ == "__main__":
    torch.set_num_threads(1)
    command, args = sys.argv[1], sys.argv[2:]
    result = conformance(args) if command == "conformance" else generate(args[0])
    print(json.dumps(result))
