"""The shared kernel build cache: which changes give a new build, and the optional loader's fallback."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.kernels import build


def test_cache_key_follows_source_flags_and_shared_headers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that includes ``cpu_float.h`` must rebuild when the header changes, not only when
    its own source does (a stale build would keep the old helper)."""
    src = tmp_path / "k.c"
    src.write_text("int f(void) { return 1; }\n")
    headers = tmp_path / "include"
    headers.mkdir()
    (headers / "cpu_float.h").write_text("/* v1 */\n")
    monkeypatch.setattr(build, "INCLUDE_DIR", headers)
    key = build._build_key(src, "cc", ["-O3"])
    assert build._build_key(src, "cc", ["-O3"]) == key
    assert build._build_key(src, "cc", ["-O2"]) != key
    (headers / "cpu_float.h").write_text("/* v2 */\n")
    changed_header = build._build_key(src, "cc", ["-O3"])
    assert changed_header != key
    src.write_text("int f(void) { return 2; }\n")
    assert build._build_key(src, "cc", ["-O3"]) != changed_header


def test_load_optional_is_none_without_a_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "compiler", lambda: None)
    src = tmp_path / "k.c"
    src.write_text("int f(void) { return 1; }\n")
    assert build.load_optional(src, "k", ["-O2", "-fPIC", "-shared"], "test kernel") is None
    with pytest.raises(build.KernelUnavailable, match="no C compiler"):
        build.build_and_load(src, "k", ["-O2", "-fPIC", "-shared"])
