"""Byte-exact KV transfer between two real processes on 127.0.0.1, for each installed backend; a room
the sender releases right after sending must go quiescent (its source pages free for reuse)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import free_port

PEER = Path(__file__).with_name("transfer_peer.py")
ROOT = Path(__file__).resolve().parents[2]


def run_pair(backend: str) -> dict[str, dict]:
    port = free_port()
    procs = {
        role: subprocess.Popen([sys.executable, str(PEER), role, backend, str(port)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for role in ("prefill", "decode")
    }
    results: dict[str, dict] = {}
    try:
        for role, proc in procs.items():
            out, err = proc.communicate(timeout=100)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            assert lines, f"{role} printed no verdict (exit {proc.returncode}):\n{err[-3000:]}"
            results[role] = json.loads(lines[-1])
            assert proc.returncode == 0, f"{role}: {results[role]}\n{err[-3000:]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    return results


@pytest.mark.timeout(150)
def test_nccl_backend_roundtrip_is_byte_exact():
    results = run_pair("nccl")
    assert results["prefill"]["ok"] and results["decode"]["ok"]
    assert results["decode"]["untouched_zero"] and results["decode"]["metadata_ok"]


@pytest.mark.timeout(150)
def test_mooncake_backend_roundtrip_is_byte_exact():
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine(-non-cuda) is not installed")
    results = run_pair("mooncake")
    assert results["prefill"]["ok"] and results["decode"]["ok"]
    assert results["decode"]["untouched_zero"] and results["decode"]["metadata_ok"]


@pytest.mark.timeout(150)
def test_nixl_backend_roundtrip_is_byte_exact():
    pytest.importorskip("nixl._api", reason="nixl is not installed")
    results = run_pair("nixl")
    assert results["prefill"]["ok"] and results["decode"]["ok"]
    assert results["decode"]["untouched_zero"] and results["decode"]["metadata_ok"]
