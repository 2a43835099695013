"""Build throw-away installed distributions (a module plus a .dist-info with entry points) in a
directory, so plugin loading is exercised through real ``importlib.metadata`` entry points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def make_dist(root: Path, dist: str, module: str, source: str, ep_name: str | None = None) -> None:
    """Install ``module`` (with ``source``) as distribution ``dist`` with one plugserve entry point."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[plugserve]\n{ep_name or module} = {module}\n")


def run_cli(args: list[str], pythonpath: Path | None = None, env_extra: dict | None = None):
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.pop("PLUGSERVE_PLUGINS", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "framework.cli.main", *args],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120,
    )


def plugins_json(pythonpath: Path | None = None, env_extra: dict | None = None) -> dict:
    proc = run_cli(["plugins", "--json"], pythonpath, env_extra)
    return {"returncode": proc.returncode, **json.loads(proc.stdout), "stderr": proc.stderr}


POOL_PLUGIN = '''
from dataclasses import dataclass
from framework.hookspecs import hookimpl

@dataclass
class Opts:
    depth: int = 1

def make(size, max_context_len, device, options=None):
    raise NotImplementedError

@hookimpl
def register_memory_pools(register):
    register("{name}", make, config=Opts)
'''
