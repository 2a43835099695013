"""Benchmark workloads as token-id prompts with output lengths (no tokenizer round trip)."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class BenchRequest:
    """One benchmark request: prompt token ids and how many tokens to generate."""

    input_ids: list[int]
    output_len: int
    group: int = 0
    """Shared-prefix group (generated-shared-prefix dataset), else 0."""


def _lengths(rng: random.Random, n: int, mean: int, range_ratio: float) -> list[int]:
    """Lengths uniform in [mean * range_ratio, mean] (range_ratio 1.0 = all equal), as SGLang does."""
    low = max(1, int(mean * range_ratio))
    return [rng.randint(low, mean) for _ in range(n)]


def random_dataset(
    num_prompts: int, input_len: int, output_len: int, vocab_size: int,
    range_ratio: float = 1.0, seed: int = 0,
) -> list[BenchRequest]:
    """Random token ids (ids 10.. avoid most special tokens)."""
    rng = random.Random(seed)
    ins = _lengths(rng, num_prompts, input_len, range_ratio)
    outs = _lengths(rng, num_prompts, output_len, range_ratio)
    return [
        BenchRequest([rng.randrange(10, vocab_size) for _ in range(i)], o) for i, o in zip(ins, outs, strict=True)
    ]


def shared_prefix_dataset(
    num_groups: int, prompts_per_group: int, system_len: int, question_len: int, output_len: int,
    vocab_size: int, seed: int = 0,
) -> list[BenchRequest]:
    """Groups of prompts that share a long system prompt and differ in a short question."""
    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        system = [rng.randrange(10, vocab_size) for _ in range(system_len)]
        for _ in range(prompts_per_group):
            question = [rng.randrange(10, vocab_size) for _ in range(question_len)]
            out.append(BenchRequest(system + question, output_len, group=g))
    rng.shuffle(out)
    return out


def jsonl_dataset(path: str | Path, tokenizer, output_len: int, num_prompts: int | None = None) -> list[BenchRequest]:
    """Prompts from a JSONL file: each line has "prompt" (text) or "input_ids", optional "output_len"."""
    out = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "input_ids" in row:
                ids = list(row["input_ids"])
            elif "prompt" in row:
                ids = tokenizer.encode(row["prompt"])
            else:
                raise ValueError(f"{path}:{line_no}: each line needs 'prompt' or 'input_ids'")
            out.append(BenchRequest(ids, int(row.get("output_len", output_len))))
            if num_prompts is not None and len(out) >= num_prompts:
                break
    return out


def load_requests(args: argparse.Namespace, tokenizer: Any, vocab_size: int | None = None) -> list[BenchRequest]:
    """The workload the dataset arguments (:func:`add_dataset_args`) describe: the one dispatch
    every bench command uses. Random ids are drawn below ``vocab_size`` (default: the
    tokenizer's size, so a served benchmark's prompts detokenize)."""
    vocab = vocab_size or len(tokenizer)
    # --seed also picks the prompts: runs against one server with different seeds share no prefixes.
    seed = getattr(args, "seed", 0)
    if args.dataset == "random":
        return random_dataset(args.num_prompts, args.input_len, args.output_len, vocab, args.range_ratio, seed=seed)
    if args.dataset == "generated-shared-prefix":
        return shared_prefix_dataset(args.gsp_groups, args.gsp_prompts_per_group, args.gsp_system_len,
                                     args.gsp_question_len, args.output_len, vocab, seed=seed)
    if not args.dataset_path:
        raise SystemExit("--dataset jsonl needs --dataset-path")
    return jsonl_dataset(args.dataset_path, tokenizer, args.output_len, args.num_prompts)


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """The workload arguments of ``bench offline``, ``serve`` and ``compare`` (same names and defaults)."""
    p.add_argument("--dataset", choices=["random", "generated-shared-prefix", "jsonl"], default="random")
    p.add_argument("--dataset-path", help="JSONL file for --dataset jsonl")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=1.0)
    p.add_argument("--gsp-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=64)
