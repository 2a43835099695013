"""``plugserve bench ab``: paired A/B timing of two source trees (or two configs) on a noisy host.

On a shared 2-core VM, two runs of the same build a minute apart can differ by 1.5x, so comparing
two separately measured medians cannot resolve a 5% change. This command keeps *both* versions
alive at once, each in its own process with its own engine, and interleaves their samples: every
sample of B runs right next to one of A, in alternating order (AB, BA, AB, ...), so drift over
seconds hits both sides of a pair alike. The figure is the median of the per-pair ratios B/A, with
the number of pairs B won, an exact two-sided sign-test p-value (how likely a split at least that
uneven is when A and B are equally fast) and the sign test's 95% confidence interval for the median
ratio (order statistics of the ratios: no assumption about the noise's distribution).

A side is a source tree: ``--a``/``--b`` name a directory that holds ``framework/`` (a checkout or
worktree) or a git revision of the running tree's repository, exported with ``git archive``. The
default compares ``HEAD`` (A) with the working tree (B), i.e. "does my uncommitted change help?".
``--a-set`` / ``--b-set`` add config overrides to one side only, so two settings of one tree can be
paired too. C kernels are compiled per tree (the build cache is keyed by the source hash); plugins
resolve through the installed entry points, so both trees must name the same plugin modules.

Workloads (:mod:`framework.bench.ab_worker`): ``decode``, one engine step of ``--rows`` requests
decoding together; ``prefill``, ``--rows`` fresh prompts of ``--input-len`` tokens to their first
token. Each side also reports its greedy tokens, and the result says whether they matched.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import select
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("ab_worker.py")


def add_ab_command(bench_sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``bench ab``."""
    p = bench_sub.add_parser("ab", help="paired A/B timing of two source trees or configs")
    common(p)
    p.add_argument("--a", default="HEAD", help="side A: a directory with framework/, or a git revision (default HEAD)")
    p.add_argument("--b", default=None, help="side B: as --a (default: the running working tree)")
    p.add_argument("--a-set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides for side A only")
    p.add_argument("--b-set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides for side B only")
    p.add_argument("--workload", choices=["decode", "prefill"], default="decode")
    p.add_argument("--rows", type=int, default=16, help="requests per sample (decode batch or prompts)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--pairs", type=int, default=30, help="paired samples")
    p.add_argument("--warm-steps", type=int, default=3, help="untimed samples before the first pair")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a side may take to start or for one sample")
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="pause between two samples (lets the other side's OpenMP threads stop spinning)")
    p.set_defaults(func=cmd_ab)


def running_tree() -> Path:
    """The source tree this process's ``framework`` package was imported from."""
    import framework

    return Path(framework.__file__).resolve().parents[1]


def source_tree(spec: str | None, repo: Path, workdir: Path, label: str) -> tuple[Path, str]:
    """The directory side ``label`` runs from, and how to describe it.

    ``None`` is the running tree; a directory must hold ``framework/``; anything else is a git
    revision of ``repo``, exported under ``workdir`` (untracked and ignored files are not in it)."""
    if spec is None:
        return repo, f"working tree {repo}"
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "framework").is_dir():
            raise ValueError(f"--{label} {spec!r}: directory has no framework/ package")
        return path.resolve(), f"tree {path.resolve()}"
    try:
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}"],
                             capture_output=True, text=True)
    except OSError as exc:
        raise ValueError(f"--{label} {spec!r} is not a directory, and git cannot run here: {exc}") from None
    if rev.returncode != 0:
        raise ValueError(f"--{label} {spec!r} is neither a directory nor a git revision of {repo}")
    commit = rev.stdout.strip()
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit],
                             capture_output=True, check=True)
    dest = workdir / label
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        # The "data" filter refuses absolute paths and links out of dest (Python >= 3.11.4).
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, **kwargs)
    return dest, f"{spec} ({commit[:12]})"


class Side:
    """One worker process: an engine from one source tree, answering one JSON line per command."""

    def __init__(self, label: str, tree: Path, worker_args: Sequence[str], log_path: Path,
                 timeout_s: float = 900.0) -> None:
        self.label, self.log_path, self.timeout_s = label, log_path, timeout_s
        env = dict(os.environ)
        # The tree goes first on the path: its ``framework`` and plugins win over the installed ones.
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        # The working directory stays the caller's, so relative paths in overrides mean what they
        # meant on the command line; imports come from PYTHONPATH, not from it.
        self.proc = subprocess.Popen([sys.executable, str(WORKER), *worker_args], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1)
        try:
            self.info = self._read()
            if not self.info.get("ready"):
                raise RuntimeError(self._failure(f"side {label} did not start: {self.info}"))
        except BaseException:  # a side that never started is not left running
            self.proc.kill()
            self.proc.wait()
            self._log.close()
            raise

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        # One reply per command, so nothing is left in the pipe's text buffer and select() on the
        # descriptor sees the next reply: a worker that hangs fails the run instead of blocking it.
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        if not ready:
            self.proc.kill()
            raise RuntimeError(self._failure(f"side {self.label} gave no reply in {self.timeout_s:.0f} s"))
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(self._failure(f"side {self.label}'s worker exited (code {self.proc.poll()})"))
        return json.loads(line)

    def _failure(self, message: str) -> str:
        self._log.flush()
        tail = self.log_path.read_text(errors="replace").splitlines()[-25:]
        return message + "\n" + "\n".join(f"  [{self.label}] {line}" for line in tail)

    def request(self, command: str) -> dict[str, Any]:
        """Send one command (``sample`` or ``finish``) and return the worker's reply."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(self._failure(f"side {self.label}: {reply['error']}"))
        return reply

    def close(self) -> None:
        """End the worker (its stdin closes, so its command loop ends) and close its log."""
        if self.proc.poll() is None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def sign_test_p(wins: int, n: int) -> float:
    """Exact two-sided sign-test p-value: the chance that a fair coin splits ``n`` pairs at least as
    unevenly as ``wins`` to ``n - wins``."""
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, n - wins) + 1))
    return min(1.0, 2 * tail / 2**n)


def median_ci_ranks(n: int, level: float = 0.95) -> tuple[int, int] | None:
    """1-based ranks ``(lo, hi)`` of the sorted pairs' ratios that bound a distribution-free
    confidence interval for their median (the sign test's: the median lies below the lo-th smallest
    ratio, or above the hi-th, with chance at most ``1 - level``); ``None`` when ``n`` pairs are too
    few for any interval at that level."""
    alpha = (1 - level) / 2
    below, k = 0.0, 0  # below: P(Binomial(n, 1/2) <= k - 1)
    while k < n and below + math.comb(n, k) / 2**n <= alpha:
        below += math.comb(n, k) / 2**n
        k += 1
    return (k, n - k + 1) if k >= 1 else None


def paired_summary(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Medians of each side, the median of the per-pair ratios B/A with its 95% interval, how often
    B was faster and the sign test's p-value for that split."""
    if len(a) != len(b) or not a:
        raise ValueError("paired samples need equally many, at least one, times per side")
    ratios = [tb / ta for ta, tb in zip(a, b, strict=True)]
    wins = sum(r < 1 for r in ratios)
    decided = sum(r != 1 for r in ratios)  # a tie favours neither side
    ordered, ranks = sorted(ratios), median_ci_ranks(len(ratios))
    return {
        "pairs": len(ratios),
        "a_median_ms": round(statistics.median(a) * 1e3, 3),
        "b_median_ms": round(statistics.median(b) * 1e3, 3),
        "ratio_b_over_a": round(statistics.median(ratios), 4),
        "b_faster_pairs": wins,
        "sign_test_p": round(sign_test_p(wins, decided), 5),
        "ratio_ci95": [round(ordered[ranks[0] - 1], 4), round(ordered[ranks[1] - 1], 4)] if ranks else None,
        "ratios": [round(r, 4) for r in ratios],
    }


def run_pairs(a: Side, b: Side, pairs: int, gap_s: float = 0.0) -> tuple[list[float], list[float]]:
    """``pairs`` samples per side, each pair in alternating order (AB, BA, ...)."""
    times: dict[str, list[float]] = {"A": [], "B": []}
    for i in range(pairs):
        for side in ((a, b) if i % 2 == 0 else (b, a)):
            if gap_s:
                time.sleep(gap_s)
            times[side.label].append(side.request("sample")["t"])
    return times["A"], times["B"]


def _worker_args(args: argparse.Namespace, extra: Sequence[str]) -> list[str]:
    out = ["--workload", args.workload, "--rows", str(args.rows), "--input-len", str(args.input_len),
           "--samples", str(args.pairs), "--warm-steps", str(args.warm_steps)]
    if args.random_model:
        out += ["--random-model", args.random_model]
    if args.model_path:
        out += ["--model-path", str(Path(args.model_path).resolve())]
    if args.config:
        out += ["--config", str(Path(args.config).resolve())]
    return [*out, "--", *args.overrides, *extra]


def cmd_ab(args: argparse.Namespace) -> int:
    from framework.bench.offline import append_result, environment

    if args.pairs < 1 or args.rows < 1 or args.input_len < 1 or args.timeout <= 0:
        raise SystemExit("bench ab: --pairs, --rows and --input-len must be at least 1, --timeout above 0")
    repo = running_tree()
    with tempfile.TemporaryDirectory(prefix="plugserve-ab-") as tmp:
        workdir = Path(tmp)
        try:
            trees = {label: source_tree(spec, repo, workdir, label.lower())
                     for label, spec in (("A", args.a), ("B", args.b))}
        except ValueError as exc:
            raise SystemExit(f"bench ab: {exc}") from None
        sides: list[Side] = []
        try:
            # One at a time: two engines loading at once would race on the random model's files.
            for label, extra in (("A", args.a_set), ("B", args.b_set)):
                sides.append(Side(label, trees[label][0], _worker_args(args, extra), workdir / f"{label}.log",
                                  args.timeout))
            a_times, b_times = run_pairs(sides[0], sides[1], args.pairs, args.gap_ms / 1e3)
            outputs = [side.request("finish")["outputs"] for side in sides]
        except RuntimeError as exc:
            raise SystemExit(f"bench ab: {exc}") from None
        finally:
            for side in sides:
                side.close()
    result = {
        "workload": args.workload, "rows": args.rows, "input_len": args.input_len,
        "a": trees["A"][1], "b": trees["B"][1],
        "a_framework": sides[0].info["framework"], "b_framework": sides[1].info["framework"],
        "a_set": args.a_set, "b_set": args.b_set,
        **paired_summary(a_times, b_times),
        "outputs_match": outputs[0] == outputs[1],
    }
    record = {"kind": "ab", "tag": args.tag, "model": sides[0].info["model"], "model_b": sides[1].info["model"],
              "overrides": list(args.overrides), **environment(), **result}
    append_result(args.output, record)
    print(json.dumps({k: v for k, v in result.items() if k != "ratios"}, indent=2))
    ci = result["ratio_ci95"]
    interval = f", 95% interval {ci[0]:.3f}-{ci[1]:.3f}" if ci else ""
    print(f"B/A = {result['ratio_b_over_a']:.3f} (median of {result['pairs']} paired ratios{interval}; B faster in "
          f"{result['b_faster_pairs']}/{result['pairs']}, sign test p = {result['sign_test_p']:.3g})")
    return 0
