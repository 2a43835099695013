"""How ``plugserve serve`` starts: the scheduler's interpreter is spawned before the config is
resolved (``framework.server.prestart``), the CLI parser imports nothing heavy, and a path that is
not a checkpoint is refused in one line before any scheduler runs."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework.cli.main import main
from framework.server.prestart import PrestartedProcess
from tests.server.conftest import PLUGSERVE, Server


def write_pid_and_args(path: str, *args: object) -> None:
    """The handed-over target of the tests: which process ran it, with what."""
    Path(path).write_text(f"{os.getpid()} {' '.join(map(str, args))}")


def test_the_parser_imports_no_torch() -> None:
    """Every ``plugserve`` command builds the whole parser first; torch (a second or two) must wait
    for a command that needs it."""
    code = ("import sys; from framework.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_a_prestarted_process_runs_the_target_it_is_handed(tmp_path: Path) -> None:
    warm = PrestartedProcess()
    proc = warm.process
    assert proc is not None and proc.is_alive()
    out = tmp_path / "ran"
    assert warm.run(write_pid_and_args, (str(out), "a", 7)) is proc
    proc.join(120)
    assert proc.exitcode == 0
    assert out.read_text() == f"{proc.pid} a 7"  # that very process ran it
    warm.cancel()  # a no-op once handed over
    with pytest.raises(RuntimeError, match="already handed over"):
        warm.run(write_pid_and_args, (str(out),))


def test_cancel_stops_a_process_that_got_no_work() -> None:
    warm = PrestartedProcess()
    proc = warm.process
    warm.cancel()
    assert proc is not None and not proc.is_alive() and proc.exitcode is not None
    assert proc not in multiprocessing.active_children()
    warm.cancel()  # twice is fine


@pytest.mark.parametrize("bad", ["bogus.key=1", "attention.backend=no_such_backend"])
def test_a_config_error_leaves_no_prestarted_process(tiny_model: Path, bad: str, capsys) -> None:
    assert main(["serve", f"model.path={tiny_model}", bad]) == 2
    assert "plugserve: error:" in capsys.readouterr().err
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_a_path_that_is_not_a_checkpoint_is_one_line(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "model"
    if kind == "empty":
        path.mkdir()
    proc = subprocess.run([PLUGSERVE, "serve", f"model.path={path}", "server.port=0"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    expected = "is not a directory" if kind == "missing" else "has no config.json"
    assert f"model.path: {path} {expected}" in proc.stderr
    assert "Traceback" not in proc.stderr and "[scheduler]" not in proc.stderr, proc.stderr


def test_the_prestarted_scheduler_is_the_servers_child(main_server: Server) -> None:
    """The scheduler that serves, handed over from the prestarted process, is the HTTP
    process's own child (its sentinel and exit code are the launcher's to watch)."""
    pid = main_server.scheduler_pid()
    stat = Path(f"/proc/{pid}/stat").read_text()
    parent = int(stat.rsplit(")", 1)[1].split()[1])
    assert parent == main_server.proc.pid


def test_building_a_model_imports_no_dynamo(tiny_model: Path) -> None:
    """``build_model`` builds on the meta device: an op computed there (an embedding's random init,
    a rotary table) runs through torch._refs and imports torch._dynamo, 0.7 s of every
    scheduler's start. The weights and tables are all filled after materialising."""
    code = ("import sys; from framework import Engine; "
            f"e = Engine(overrides=['model.path={tiny_model}', 'kv_cache.max_total_tokens=256'], progress=False); "
            "e.generate([[5, 6, 7]], {'max_new_tokens': 2}); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
