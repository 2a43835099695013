"""Run the ``bench compare`` workload through llama.cpp (llama-cpp-python) in *another* interpreter.

llama-cpp-python compiles llama.cpp at install time, so it lives in its own virtual environment;
``plugserve bench compare --llamacpp-python /venv/bin/python --llamacpp-converter
/src/llama.cpp/convert_hf_to_gguf.py`` runs this file there. It reads ``{"model", "converter",
"outtype", "kv_type", "gguf", "prompts": [[ids]], "output_lens", "threads"}`` from the JSON file in
argv[1] and writes ``{"elapsed_s", "output_ids", "gguf"}`` to argv[2].

``kv_type`` is plugserve's KV cache dtype. llama.cpp's own default is an f16 cache, which would
read half the K/V bytes of an fp32 plugserve run; the comparison sets llama.cpp's cache to the
same precision as plugserve's instead.

The Hugging Face checkpoint is converted to GGUF once with llama.cpp's own converter (it ships in
the llama-cpp-python source archive, not in the wheel). A tokenizer trained locally is unknown to
the converter's pre-tokenizer table; the prompts are token ids, so its choice does not matter here
and it is mapped to ``gpt-2``.

Batched generation uses the low-level API the way llama.cpp's ``batched`` example does: one
sequence id per request, a non-unified KV cache (each sequence has its own slice, so attention
does not scan the other sequences' cells), prompts submitted in batches with logits only for each
prompt's last token, then one decode call per step carrying every unfinished sequence's token.
Sampling is greedy (argmax of the returned logits).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time


def convert(model: str, converter: str, outtype: str, target: str) -> None:
    """Write ``target`` from the HF directory ``model`` with llama.cpp's converter (in-process)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(converter)))
    from conversion import base  # the converter's package, next to convert_hf_to_gguf.py

    original = base.TextModel.get_vocab_base_pre

    def vocab_pre(self, tokenizer):  # noqa: ANN001 - the converter's own signature
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"  # an unknown (locally trained) BPE tokenizer; prompts are token ids

    base.TextModel.get_vocab_base_pre = vocab_pre
    import convert_hf_to_gguf

    argv, sys.argv = sys.argv, [converter, model, "--outtype", outtype, "--outfile", target]
    try:
        convert_hf_to_gguf.main()
    finally:
        sys.argv = argv


#: torch dtype name -> ggml type id (ggml.h: GGML_TYPE_F32 = 0, F16 = 1, BF16 = 30).
GGML_KV_TYPES = {"float32": 0, "float16": 1, "bfloat16": 30}


def generate(gguf: str, prompts: list[list[int]], output_lens: list[int], threads: int,
             kv_type: str = "float32", prefill_batch: int = 2048) -> tuple[float, list[list[int]]]:
    """Greedy batched generation; returns (seconds, output ids per prompt)."""
    import llama_cpp as L
    import numpy as np

    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(gguf.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    n_seq = len(prompts)
    per_seq = max(len(p) + n for p, n in zip(prompts, output_lens, strict=True)) + 16
    cparams = L.llama_context_default_params()
    cparams.n_ctx = per_seq * n_seq
    cparams.n_batch = prefill_batch
    cparams.n_seq_max = n_seq
    cparams.kv_unified = False
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.type_k = cparams.type_v = GGML_KV_TYPES[kv_type]
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(max(prefill_batch, n_seq), 0, 1)

    def submit(entries: list[tuple[int, int, int, bool]]) -> None:
        """Decode one batch of (token, position, sequence, wants_logits) entries."""
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        status = L.llama_decode(ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")

    def argmax(i: int) -> int:
        ptr = L.llama_get_logits_ith(ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (vocab,))))

    def run(measure: list[int]) -> list[list[int]]:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        outputs: list[list[int]] = [[] for _ in measure]
        # prefill: whole prompts packed into batches of at most prefill_batch tokens
        pending: list[tuple[int, int, int, bool]] = []
        lasts: list[tuple[int, int]] = []  # (batch index of a prompt's last token, its slot in measure)

        def flush() -> None:
            submit(pending)
            for index, k in lasts:  # llama_get_logits_ith takes the token's index in the batch
                outputs[k].append(argmax(index))
            pending.clear()
            lasts.clear()

        for k, seq in enumerate(measure):
            ids = prompts[seq]
            if len(ids) > prefill_batch:
                raise ValueError(f"a prompt of {len(ids)} tokens exceeds the {prefill_batch}-token batch")
            if pending and len(pending) + len(ids) > prefill_batch:
                flush()
            pending.extend((t, p, seq, p == len(ids) - 1) for p, t in enumerate(ids))
            lasts.append((len(pending) - 1, k))
        if pending:
            flush()
        # decode: one token per unfinished sequence per step
        while True:
            live = [k for k, seq in enumerate(measure) if len(outputs[k]) < output_lens[seq]]
            if not live:
                return outputs
            submit([(outputs[k][-1], len(prompts[measure[k]]) + len(outputs[k]) - 1, measure[k], True) for k in live])
            for row, k in enumerate(live):
                outputs[k].append(argmax(row))

    run([0])  # warm-up outside the timing (thread pools, first-call allocations)
    start = time.perf_counter()
    outputs = run(list(range(n_seq)))
    elapsed = time.perf_counter() - start
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return elapsed, outputs


def main(in_path: str, out_path: str) -> None:
    with open(in_path) as f:
        job = json.load(f)
    gguf = job["gguf"]
    if not os.path.exists(gguf):
        tmp = gguf + ".partial"
        convert(job["model"], job["converter"], job["outtype"], tmp)
        os.replace(tmp, gguf)
    elapsed, outputs = generate(gguf, job["prompts"], job["output_lens"], job["threads"], job["kv_type"])
    with open(out_path, "w") as f:
        json.dump({"elapsed_s": elapsed, "output_ids": outputs, "gguf": gguf}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
