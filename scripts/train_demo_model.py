"""Train the tiny Shakespeare demo model that plugserve serves by default, with no download.

The result is a real Hugging Face checkpoint (a small ``LlamaForCausalLM`` plus a byte-level BPE fast
tokenizer with a chat template), so the server exercises exactly the same loading path as for any hub
model. It is small enough (a few MB) to ship inside the package under ``framework/assets/``.

Usage (from the repository root)::

    python scripts/train_demo_model.py                      # ~12 min on one CPU thread
    python scripts/train_demo_model.py --steps 345 --max-seconds 0   # exact replay (see training_log.json)

The corpus is read from outside the repository and is never copied into it.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = REPO_ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
DEFAULT_OUTPUT = REPO_ROOT / "framework" / "assets" / "tiny-shakespeare"

BOS_EOS = "<|endoftext|>"
CHAT_TOKENS = ["<|user|>", "<|assistant|>", "<|end|>"]
# Every message is "<|role|>\ncontent<|end|>\n"; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="plain-text training corpus")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="checkpoint directory to (re)write")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (upper bound if a budget is set)")
    p.add_argument("--max-seconds", type=float, default=720.0, help="wall-clock budget; 0 = use --steps only")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args()
    if args.max_seconds <= 0 and args.steps is None:
        p.error("--max-seconds 0 needs --steps")
    return args


def train_tokenizer(text: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a GPT-2 style byte-level BPE tokenizer and wrap it as a transformers fast tokenizer."""
    tok = Tokenizer(models.BPE())
    # Byte-level: any UTF-8 input is encodable, so the server never sees an unknown token.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS_EOS, *CHAT_TOKENS],  # ids 0..3
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_EOS,
        eos_token=BOS_EOS,
        pad_token=BOS_EOS,
        additional_special_tokens=CHAT_TOKENS,
        model_max_length=512,
        chat_template=CHAT_TEMPLATE,
    )


def build_model(vocab_size: int, bos_id: int) -> LlamaForCausalLM:
    """A ~3.5M-parameter Llama with GQA, so the demo covers the same code paths as real models."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,  # halves the embedding cost, which dominates at this size
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=bos_id,
        eos_token_id=bos_id,
        pad_token_id=bos_id,
    )
    # fp32 on purpose: the demo must run (and be tested) on CPUs without bf16 support.
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa").float()


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    """Linear warm-up then cosine decay to 10% of the peak.

    The warm-up does not depend on ``total``, so the steps taken before the budget is calibrated are
    the same as in a re-run with a fixed ``--steps``.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def sample_batch(data: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator, bos_id: int) -> torch.Tensor:
    """Random contiguous windows of ``seq_len + 1`` tokens (inputs and shifted targets)."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
    rows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
    # The corpus is one document, so BOS would otherwise never be seen; some clients prepend it, and
    # a quarter of the rows starting with it teaches the model to treat it as "start of text".
    rows[torch.rand(batch, generator=gen) < 0.25, 0] = bos_id
    return rows


@torch.no_grad()
def mean_loss(model: LlamaForCausalLM, rows: torch.Tensor, batch: int) -> float:
    """Token-averaged next-token cross-entropy (nats) over ``rows``."""
    model.eval()
    total, count = 0.0, 0
    for chunk in rows.split(batch):
        logits = model(input_ids=chunk[:, :-1]).logits
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    model.train()
    return total / count


def main() -> None:
    """Train the tokenizer and the model, then write the checkpoint and its training log."""
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()

    text = args.corpus.read_text(encoding="utf-8")
    split = int(len(text) * 0.95)  # the last 5% is held out, never seen by the tokenizer or the model
    train_text, val_text = text[:split], text[split:]
    tokenizer = train_tokenizer(train_text, args.vocab_size)
    bos_id = tokenizer.bos_token_id
    # verbose=False: the whole corpus is longer than model_max_length, which is expected here.
    train_ids = torch.tensor(tokenizer(train_text, verbose=False)["input_ids"], dtype=torch.long)
    val_ids = torch.tensor(tokenizer(val_text, verbose=False)["input_ids"], dtype=torch.long)
    print(
        f"tokenizer: {len(tokenizer)} tokens; train {len(train_ids)} / val {len(val_ids)} tokens "
        f"({len(val_text) / len(val_ids):.2f} chars/token)",
        flush=True,
    )

    model = build_model(len(tokenizer), bos_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    # Fixed evaluation sets: every non-overlapping validation window, and as many random training
    # windows, so the two losses are comparable and the curve is not batch noise.
    win = args.seq_len + 1
    val_rows = val_ids[: len(val_ids) // win * win].view(-1, win)
    eval_gen = torch.Generator().manual_seed(args.seed + 1)
    starts = torch.randint(0, len(train_ids) - win, (len(val_rows),), generator=eval_gen).tolist()
    train_rows = torch.stack([train_ids[s : s + win] for s in starts])
    chars_per_token = len(val_text) / len(val_ids)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms: decaying them only hurts
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)

    t_eval = time.time()
    val_loss = mean_loss(model, val_rows, args.batch_size)
    t_eval = time.time() - t_eval
    print(f"step 0: val {val_loss:.3f}", flush=True)

    total = args.steps if args.max_seconds <= 0 else (args.steps or 10**9)
    calib_start, calib_from, calib_to = 0.0, 2, 7  # skip the first, slower steps
    train_start = time.time()
    step, train_loss, history = 0, float("nan"), []
    while step < total:
        if args.max_seconds > 0 and step == calib_from:
            calib_start = time.time()
        if args.max_seconds > 0 and step == calib_to:
            # Fix the step count from measured speed (evaluations included), so the cosine schedule ends
            # on time; the log records it, and `--steps N --max-seconds 0` replays the run exactly.
            per_step = (time.time() - calib_start) / (calib_to - calib_from)
            per_step += 2 * t_eval / args.eval_interval
            remaining = args.max_seconds - (time.time() - train_start)
            total = min(total, step + max(1, int(remaining / per_step)))
            print(f"calibrated: {per_step:.2f} s/step -> {total} steps", flush=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, args.warmup, args.lr)
        rows = sample_batch(train_ids, args.batch_size, args.seq_len, gen, bos_id)
        logits = model(input_ids=rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % args.eval_interval == 0 or step == total:
            train_loss = mean_loss(model, train_rows, args.batch_size)
            val_loss = mean_loss(model, val_rows, args.batch_size)
            elapsed = time.time() - train_start
            history.append({"step": step, "train_loss": round(train_loss, 4), "val_loss": round(val_loss, 4)})
            print(
                f"step {step}/{total}: batch {loss.item():.3f} train {train_loss:.3f} val {val_loss:.3f} "
                f"({val_loss / chars_per_token:.3f} nats/char) lr {opt.param_groups[0]['lr']:.2e} "
                f"{elapsed:.0f}s",
                flush=True,
            )
    train_seconds = time.time() - train_start

    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id,
        eos_token_id=bos_id,
        pad_token_id=bos_id,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        max_new_tokens=128,
    )
    prompt = "ROMEO:"
    torch.manual_seed(args.seed)
    out = model.generate(**tokenizer(prompt, return_tensors="pt"))
    sample = tokenizer.decode(out[0], skip_special_tokens=True)
    print(f"--- sample ---\n{sample}\n--------------", flush=True)

    # Write into a sibling temp dir and swap it in, so an interrupted run never leaves a half checkpoint
    # (or stale files from an older run) where the server looks.
    tmp = args.output.with_name(args.output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json, where older
    # transformers releases and simple readers look for it.
    tokenizer.save_pretrained(tmp, save_jinja_files=False)
    # transformers 5 writes its own class and key names; the 4.x names load in both 4.45+ and 5.x.
    cfg_path = tmp / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens", CHAT_TOKENS)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    log = {
        "train_loss": round(train_loss, 4),
        "val_loss": round(val_loss, 4),
        "val_loss_per_char": round(val_loss / chars_per_token, 4),
        "steps": step,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "parameters": n_params,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t0, 1),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seed": args.seed,
        "threads": args.threads,
        "replay": f"python scripts/train_demo_model.py --steps {step} --max-seconds 0 --seed {args.seed}",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "sample": {"prompt": prompt, "output": sample},
        "history": history,
    }
    (tmp / "training_log.json").write_text(json.dumps(log, indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(args.output, ignore_errors=True)
    tmp.rename(args.output)
    for f in args.output.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; the package data must be readable by everyone
    size = sum(f.stat().st_size for f in args.output.iterdir())
    print(f"saved {args.output} ({size / 1e6:.1f} MB) in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
