"""``plugserve bench ab``: paired A/B samples from two real worker processes (no timing asserted).

The statistics are checked against brute-force enumeration; the end-to-end runs check that each
side really imports its own tree, that side-only overrides reach only that side, that both sides
step in lockstep (identical trees give identical greedy tokens) and that bad sides fail clearly.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from framework.bench.ab import median_ci_ranks, paired_summary, running_tree, sign_test_p, source_tree
from framework.cli.main import main

REPO = running_tree()


def _is_git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    probe = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "HEAD"], capture_output=True)
    return probe.returncode == 0


needs_git = pytest.mark.skipif(not _is_git_checkout(), reason="the source tree is not a git checkout with a HEAD")


@pytest.mark.parametrize("n", range(0, 11))
def test_sign_test_p_matches_enumerating_every_outcome(n: int) -> None:
    outcomes = list(itertools.product((0, 1), repeat=n))
    for wins in range(n + 1):
        extreme = min(wins, n - wins)
        as_uneven = sum(min(sum(o), n - sum(o)) <= extreme for o in outcomes)
        assert sign_test_p(wins, n) == pytest.approx(as_uneven / len(outcomes))


def _binomial_cdf(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k), by counting every outcome of n fair coins."""
    return sum(sum(o) <= k for o in itertools.product((0, 1), repeat=n)) / 2**n


@pytest.mark.parametrize("n", [1, 5, 6, 9, 10, 14])
def test_median_interval_ranks_are_the_tightest_with_95_percent_coverage(n: int) -> None:
    ranks = median_ci_ranks(n)
    if ranks is None:  # not even the extreme ratios bound the median with 95%
        assert 1 - 2 * _binomial_cdf(0, n) < 0.95
        return
    lo, hi = ranks
    assert hi == n - lo + 1
    # The median lies outside [r_lo, r_hi] when at most lo - 1 ratios fall below it (or above).
    assert 1 - 2 * _binomial_cdf(lo - 1, n) >= 0.95
    assert lo + 1 > hi - 1 or 1 - 2 * _binomial_cdf(lo, n) < 0.95  # one rank tighter falls short


def test_paired_summary_uses_per_pair_ratios() -> None:
    # The medians of the sides would call these equal; every pair says B is 20% faster.
    a = [1.0, 3.0, 2.0, 10.0, 5.0]
    b = [0.8 * x for x in a]
    summary = paired_summary(a, b)
    assert summary["ratio_b_over_a"] == pytest.approx(0.8)
    assert summary["b_faster_pairs"] == 5 and summary["pairs"] == 5
    assert summary["sign_test_p"] == pytest.approx(sign_test_p(5, 5))
    assert summary["a_median_ms"] == pytest.approx(3000.0) and summary["b_median_ms"] == pytest.approx(2400.0)
    with pytest.raises(ValueError):
        paired_summary([1.0], [1.0, 2.0])
    assert summary["ratio_ci95"] is None  # 5 pairs are too few for a 95% interval
    spread = [0.70 + 0.01 * i for i in range(10)]  # ratios 0.70 .. 0.79, shuffled into pairs
    ten = paired_summary([1.0] * 10, spread[::-1])
    assert ten["ratio_ci95"] == pytest.approx([0.71, 0.78])  # ranks 2 and 9 of 10


def test_source_tree_rejects_what_is_not_a_tree(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no framework/"):
        source_tree(str(tmp_path), REPO, tmp_path, "a")
    with pytest.raises(ValueError, match="neither a directory nor a git revision"):
        source_tree("no-such-revision-xyz", REPO, tmp_path, "b")


@needs_git
def test_source_tree_exports_the_revision_byte_for_byte(tmp_path: Path) -> None:
    tree, label = source_tree("HEAD", REPO, tmp_path, "a")
    assert tree == tmp_path / "a" and label.startswith("HEAD (")
    committed = subprocess.run(["git", "-C", str(REPO), "show", "HEAD:framework/__init__.py"],
                               capture_output=True, check=True).stdout
    assert (tree / "framework" / "__init__.py").read_bytes() == committed


def _run_ab(tmp_path: Path, model: Path, *extra: str) -> dict:
    out = tmp_path / "ab.jsonl"
    assert main(["bench", "ab", "--model-path", str(model), "--pairs", "3", "--rows", "2", "--input-len", "8",
                 "--warm-steps", "1", "--output", str(out), *extra]) == 0
    return json.loads(out.read_text().splitlines()[-1])


@needs_git
def test_decode_pairs_a_revision_with_the_working_tree(tmp_path: Path, bench_model: Path) -> None:
    record = _run_ab(tmp_path, bench_model, "--a", "HEAD", "--workload", "decode")
    assert record["kind"] == "ab" and record["pairs"] == 3 and len(record["ratios"]) == 3
    # Side A imported the exported revision, side B the running tree.
    assert record["a_framework"].endswith("/a/framework") and not record["a_framework"].startswith(str(REPO))
    assert record["b_framework"] == str(REPO / "framework")
    assert record["a_median_ms"] > 0 and record["b_median_ms"] > 0 and 0 <= record["b_faster_pairs"] <= 3
    # Both engines decoded the same requests in lockstep: greedy tokens agree.
    assert record["outputs_match"] is True


def test_side_overrides_reach_one_side_only(tmp_path: Path, bench_model: Path) -> None:
    record = _run_ab(tmp_path, bench_model, "--a", str(REPO), "--workload", "prefill",
                     "--b-set", "kv_cache.page_size=16", "kv_cache.max_total_tokens=4096")
    assert record["model"]["page_size"] == 1 and record["model_b"]["page_size"] == 16
    assert record["b_set"] == ["kv_cache.page_size=16", "kv_cache.max_total_tokens=4096"]
    assert record["pairs"] == 3 and record["workload"] == "prefill"


def test_a_side_that_fails_to_start_is_reported_with_its_log(tmp_path: Path, bench_model: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match=r"side A did not start|side A's worker exited") as info:
        main(["bench", "ab", "--model-path", str(bench_model), "--a", str(REPO), "--pairs", "1",
              "--output", str(tmp_path / "x.jsonl"), "--a-set", "attention.backend=no-such-backend"])
    assert "no-such-backend" in str(info.value)  # the worker's own error, from its log
    assert not (tmp_path / "x.jsonl").exists()


def test_bad_arguments_exit_with_a_message(tmp_path: Path, bench_model: Path) -> None:
    with pytest.raises(SystemExit, match="--pairs, --rows and --input-len must be at least 1"):
        main(["bench", "ab", "--model-path", str(bench_model), "--pairs", "0"])
    with pytest.raises(SystemExit, match="neither a directory nor a git revision"):
        main(["bench", "ab", "--model-path", str(bench_model), "--a", "no-such-revision-xyz"])


def test_a_side_that_hangs_is_killed_after_the_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import framework.bench.ab as ab

    hanging = tmp_path / "hang.py"
    hanging.write_text("import sys, time\nprint('loading', file=sys.stderr, flush=True)\ntime.sleep(60)\n")
    monkeypatch.setattr(ab, "WORKER", hanging)
    with pytest.raises(RuntimeError, match=r"side A gave no reply in 1 s[\s\S]*\[A\] loading"):
        ab.Side("A", tmp_path, [], tmp_path / "A.log", timeout_s=1.0)
