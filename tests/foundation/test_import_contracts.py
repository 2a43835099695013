"""The import direction (pyproject's [tool.importlinter] contracts, drawn in docs/architecture.md)
holds: lint-imports, the real import-linter, run over the checkout; plus a check that the
contracts can fail."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def lint_imports() -> Path:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: import-linter is in the test extra (scripts/setup.sh installs it)")
    return LINT_IMPORTS


@pytest.mark.timeout(300)
def test_every_import_contract_is_kept(lint_imports: Path) -> None:
    result = _lint(REPO_ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Contracts: 4 kept, 0 broken." in result.stdout, result.stdout[-2000:]


@pytest.mark.timeout(300)
def test_a_lower_layer_importing_a_higher_one_is_caught(lint_imports: Path, tmp_path: Path) -> None:
    """A copy of the tree where the scheduler imports the server: the layers contract breaks."""
    for name in ("framework", "plugins", "benchmarks"):
        shutil.copytree(REPO_ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "framework" / "scheduler" / "policy.py"
    target.write_text(target.read_text() + "\nfrom framework.server import app  # noqa: E402,F401\n")
    result = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode != 0, result.stdout[-3000:]
    assert "framework layers: each imports only the layers below it BROKEN" in result.stdout, result.stdout[-3000:]
    assert "framework.scheduler.policy -> framework.server.app" in result.stdout
