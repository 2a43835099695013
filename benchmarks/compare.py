"""``plugserve bench compare``: one offline workload through plugserve and its peers, in one run.

Peers, each run only when importable (otherwise skipped with the reason printed and recorded):
- HF transformers ``generate``: batched with left padding, greedy, exactly ``output_len`` new
  tokens (``min_new_tokens`` = ``max_new_tokens``, so EOS cannot end a row early);
- vLLM's offline ``LLM`` API: the same token-id prompts, greedy, ``ignore_eos``;
- llama.cpp through llama-cpp-python (``--llamacpp-python``, its own venv): the checkpoint converted
  to GGUF at the same precision, batched with one sequence per request, greedy.
Running them side by side in one process on one idle machine is what makes the ratios
meaningful: figures taken at different times on a shared machine differ by 2x and more.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from typing import Any

from framework.bench.datasets import BenchRequest

PEERS = ("transformers", "vllm", "llama.cpp")


def add_compare_command(bench_sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``bench compare`` (the ``plugserve.bench`` entry point; ``common`` adds the model
    arguments every bench command shares)."""
    from framework.bench.datasets import add_dataset_args

    p = bench_sub.add_parser("compare", help="one offline workload through plugserve, transformers and vLLM")
    common(p)
    add_dataset_args(p)
    p.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS), help="peers to run (default: all)")
    p.add_argument("--vllm-python", default=None,
                   help="python of a separate venv with vllm installed: run the vLLM peer there "
                        "(default: import vllm in this process)")
    p.add_argument("--llamacpp-python", default=None,
                   help="python of a venv with llama-cpp-python: run the llama.cpp peer there")
    p.add_argument("--llamacpp-converter", default=None,
                   help="llama.cpp's convert_hf_to_gguf.py (in the llama-cpp-python source archive, "
                        "vendor/llama.cpp/); the GGUF is cached under the temp dir")
    p.add_argument("--hf-batch-size", type=int, default=0, help="transformers batch size (default: every prompt)")
    p.set_defaults(func=cmd_compare)


def _figures(num: int, in_tokens: int, out_tokens: int, elapsed: float) -> dict[str, Any]:
    """The same keys ``run_offline`` reports, so every system's figures line up."""
    return {"num_requests": num, "elapsed_s": round(elapsed, 3), "input_tokens": in_tokens,
            "output_tokens": out_tokens, "output_throughput": round(out_tokens / elapsed, 2),
            "input_throughput": round(in_tokens / elapsed, 2), "request_throughput": round(num / elapsed, 3)}


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Share of requests whose greedy tokens are identical.

    Informational, not a pass/fail: fp32 kernels that sum in another order can flip a near-tie
    (common in random models), after which a request's tokens differ. A share near zero, though,
    says the two systems did not run the same workload (wrong padding, prompts, or lengths).
    """
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return round(same / max(len(ours), 1), 3)


def run_transformers(model_path: str, requests: list[BenchRequest], batch_size: int = 0,
                     outputs: list[list[int]] | None = None, device: str = "cpu",
                     dtype: str = "float32") -> dict[str, Any]:
    """HF ``generate`` over the workload in batches, left padded, greedy, no early EOS, on
    plugserve's device and dtype (so that a GPU run compares GPU with GPU, bf16 with bf16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    batch_size = batch_size or len(requests)

    def generate(batch: list[BenchRequest], keep: bool = True) -> int:
        width = max(len(r.input_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding: every prompt ends where generation starts
            ids[row, width - len(r.input_ids):] = torch.tensor(r.input_ids)
            mask[row, width - len(r.input_ids):] = 1
        # One length per batch: generate() cannot stop rows separately without EOS, so a batch of
        # unequal output lengths generates the longest for all; only the tokens each request asked
        # for are counted, as for the other systems (the surplus is static batching's waste).
        new = max(r.output_len for r in batch)
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=pad)
        if out.is_cuda:  # kernels run asynchronously: the timing must include all of them
            torch.cuda.synchronize()
        if keep and outputs is not None:
            outputs.extend(row[width:width + r.output_len].cpu().tolist() for row, r in zip(out, batch, strict=True))
        return sum(min(r.output_len, out.shape[1] - width) for r in batch)

    generate(requests[:1], keep=False)  # warm-up: lazy initialisation stays out of the timing
    start = time.perf_counter()
    out_tokens = sum(generate(requests[i:i + batch_size]) for i in range(0, len(requests), batch_size))
    elapsed = time.perf_counter() - start
    return {**_figures(len(requests), sum(len(r.input_ids) for r in requests), out_tokens, elapsed),
            "batch_size": batch_size}


def run_vllm(model_path: str, requests: list[BenchRequest], outputs: list[list[int]] | None = None,
             dtype: str = "float32") -> dict[str, Any]:
    """vLLM's offline ``LLM.generate`` on the same token-id prompts (raises ImportError without vLLM)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_path, dtype=dtype, seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    prompts = [{"prompt_token_ids": r.input_ids} for r in requests]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if outputs is not None:
        outputs.extend(list(o.outputs[0].token_ids) for o in outs)
    return _figures(len(requests), sum(len(r.input_ids) for r in requests), out_tokens, elapsed)


def _run_peer_script(python: str, script_name: str, job: dict[str, Any], requests: list[BenchRequest],
                     outputs: list[list[int]] | None) -> dict[str, Any]:
    """Run ``script_name`` (next to this file) under ``python`` with the workload added to ``job``;
    it writes ``{"elapsed_s", "output_ids"}``, returned here as the usual figures."""
    import subprocess
    import tempfile
    from pathlib import Path

    script = Path(__file__).with_name(script_name)
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps({**job, "prompts": [r.input_ids for r in requests],
                                        "output_lens": [r.output_len for r in requests]}))
        proc = subprocess.run([python, str(script), str(job_path), str(result)], capture_output=True, text=True)
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"{python} {script.name} exited with {proc.returncode}: {tail}")
        done = json.loads(result.read_text())
    if outputs is not None:
        outputs.extend(done["output_ids"])
    out_tokens = sum(len(o) for o in done["output_ids"])
    return _figures(len(requests), sum(len(r.input_ids) for r in requests), out_tokens, done["elapsed_s"])


def run_vllm_elsewhere(python: str, model_path: str, requests: list[BenchRequest],
                       outputs: list[list[int]] | None = None, dtype: str = "float32") -> dict[str, Any]:
    """:func:`run_vllm` in another interpreter (vLLM's own venv), through ``vllm_peer.py``."""
    return _run_peer_script(python, "vllm_peer.py", {"model": model_path, "dtype": dtype}, requests, outputs)


#: plugserve's dtype -> the GGUF type llama.cpp's converter writes for it.
GGUF_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def gguf_path(model_path: str, outtype: str) -> str:
    """Where the converted checkpoint is cached: keyed by the model path and its weights' mtimes,
    so a rewritten checkpoint is converted again."""
    import hashlib
    import tempfile
    from pathlib import Path

    files = sorted(Path(model_path).glob("*.safetensors")) + [Path(model_path) / "config.json"]
    key = hashlib.sha256("|".join(f"{f.resolve()}:{f.stat().st_mtime_ns}" for f in files if f.exists()).encode())
    name = f"{Path(model_path).name}-{key.hexdigest()[:12]}-{outtype}.gguf"
    return str(Path(tempfile.gettempdir()) / "plugserve-gguf" / name)


def run_llamacpp_elsewhere(python: str, converter: str | None, model_path: str, requests: list[BenchRequest],
                           outputs: list[list[int]] | None = None, dtype: str = "float32",
                           threads: int = 0, kv_dtype: str | None = None) -> dict[str, Any]:
    """llama.cpp batched greedy generation in llama-cpp-python's venv, through ``llamacpp_peer.py``,
    with its KV cache at plugserve's KV precision (``kv_dtype``, default the model dtype)."""
    import os

    import torch

    if dtype not in GGUF_TYPES:
        raise ValueError(f"no GGUF type for dtype {dtype}")
    gguf = gguf_path(model_path, GGUF_TYPES[dtype])
    if converter is None and not os.path.exists(gguf):
        raise ValueError("--llamacpp-converter is needed to convert the checkpoint to GGUF the first time")
    os.makedirs(os.path.dirname(gguf), exist_ok=True)
    job = {"model": model_path, "converter": converter, "outtype": GGUF_TYPES[dtype], "gguf": gguf,
           "kv_type": kv_dtype or dtype, "threads": threads or torch.get_num_threads()}
    return _run_peer_script(python, "llamacpp_peer.py", job, requests, outputs)


def _peer(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one peer; a missing package or a failure is a recorded skip, not the end of the run."""
    try:
        return fn()
    except ImportError as exc:
        return {"skipped": f"{name} is not installed ({type(exc).__name__}: {exc})"}
    except Exception as exc:  # a peer's own failure must not lose the figures already measured
        return {"skipped": f"{name} failed: {type(exc).__name__}: {exc}"}


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """plugserve's output throughput over each measured peer's."""
    ours = systems.get("plugserve", {}).get("output_throughput")
    out = {}
    for name, fig in systems.items():
        theirs = fig.get("output_throughput")
        if name != "plugserve" and ours and theirs:
            out[f"plugserve/{name}"] = round(ours / theirs, 3)
    return out


def cmd_compare(args: argparse.Namespace) -> int:
    from framework.bench.datasets import load_requests
    from framework.bench.offline import append_result, engine_from_args, environment, run_offline

    engine, cfg = engine_from_args(args)
    model_path = str(cfg.model.path)
    requests = load_requests(args, engine.tokenizer)
    tokens: dict[str, list[list[int]]] = {name: [] for name in ("plugserve", *PEERS)}
    systems: dict[str, dict[str, Any]] = {"plugserve": run_offline(engine, requests, outputs=tokens["plugserve"])}
    model_desc = engine.runner.describe()
    device = str(model_desc.get("device", "cpu"))
    dtype = str(model_desc.get("dtype", "float32")).removeprefix("torch.")
    kv_dtype = str(engine.runner.kv_cache.dtype).removeprefix("torch.")
    del engine  # free its KV pool and weights before the peers load theirs
    gc.collect()
    _empty_cuda_cache()  # vLLM sizes its KV cache from the GPU memory free when it starts
    if "transformers" in args.peers:
        systems["transformers"] = _peer("transformers",
                                        lambda: run_transformers(model_path, requests, args.hf_batch_size,
                                                                 tokens["transformers"], device, dtype))
    gc.collect()
    _empty_cuda_cache()
    if "vllm" in args.peers:
        if args.vllm_python:
            systems["vllm"] = _peer("vllm", lambda: run_vllm_elsewhere(args.vllm_python, model_path, requests,
                                                                       tokens["vllm"], dtype))
        else:
            systems["vllm"] = _peer("vllm", lambda: run_vllm(model_path, requests, tokens["vllm"], dtype))
    if "llama.cpp" in args.peers:
        if args.llamacpp_python:
            systems["llama.cpp"] = _peer("llama.cpp", lambda: run_llamacpp_elsewhere(
                args.llamacpp_python, args.llamacpp_converter, model_path, requests, tokens["llama.cpp"], dtype,
                kv_dtype=kv_dtype))
        else:
            systems["llama.cpp"] = {"skipped": "llama.cpp runs only in its own venv: pass --llamacpp-python"}
    for name, fig in systems.items():
        if name != "plugserve" and "skipped" not in fig:
            fig["greedy_agreement_with_plugserve"] = agreement(tokens["plugserve"], tokens[name])
    result = {"dataset": args.dataset, "systems": systems, "ratios": ratios(systems)}

    for name, fig in systems.items():
        if "skipped" in fig:
            print(f"{name:<14} skipped: {fig['skipped']}")
        else:
            same = fig.get("greedy_agreement_with_plugserve")
            print(f"{name:<14} output {fig['output_throughput']:>10.2f} tok/s   input "
                  f"{fig['input_throughput']:>10.2f} tok/s   {fig['elapsed_s']:.3f} s"
                  + (f"   same greedy tokens as plugserve: {same:.0%} of requests" if same is not None else ""))
    for name, value in result["ratios"].items():
        print(f"{name:<28} {value:.3f}x output throughput")
    append_result(args.output, {"kind": "compare", "tag": args.tag, "model": model_desc,
                                "overrides": list(args.overrides), **environment(), **result})
    print(json.dumps(result["ratios"]))
    return 0
