"""A conformance kit for KV transfer backends (``register_transfer_backends``), between two real
processes.

A backend author runs it from their own test suite::

    from framework.testing.transfer_conformance import assert_conformant

    def test_my_backend_conforms():
        assert_conformant("my_transfer")                 # or the factory: assert_conformant(MyBackend.create)

The kit starts two processes, a sender (role ``prefill``) and a receiver (role ``decode``), each
running this module (``python -m framework.testing.transfer_conformance``) with its own KV cache
(2 layers x 16 pages of 4 tokens, float32; the sender's filled with seeded random values, the
receiver's with other seeded values) and one backend built from the factory. This process relays
the endpoints and drives both sides one step at a time over their stdin/stdout. The checks:

- ``roundtrip``: rooms with one page, runs of pages, scattered destinations, a 63-bit room
  number, binary metadata and empty metadata; the receiver's destination pages equal the sender's
  source pages byte for byte, every other page of the receiver is untouched, the sender's pages are
  unchanged, ``metadata(room)`` is what was sent, and both sides' tasks move forward through the
  state machine (``bootstrapping`` -> ``waiting_for_input`` -> ``transferring`` -> ``success``,
  states may be skipped, never revisited) to ``success``. Releasing a room, or an unknown room, is
  fine. Never optional;
- ``timeout``: a room the receiver expects but the sender never sends stays pending (not final,
  not ``transferring``) for ``timeout_s``; ``TransferTask.check_timeout`` (what the schedulers
  call) then fails it, ``poll`` reports it failed, it goes quiescent once released, and the next
  room still arrives intact;
- ``quiescence``: a room the sender releases right after ``send`` goes quiescent within the
  deadline (the backend stops reading its pages), so does one the receiver releases, and the link
  still carries the next room intact;
- ``link_error_sender``: the receiver process is killed; the sender's ``link_error()`` names the
  broken link within ``link_error_deadline_s`` (the kit keeps sending small rooms meanwhile, as a
  busy server would);
- ``link_error_receiver``: on a second pair, the sender process is killed; the receiver's
  ``link_error()`` names it and a room it was expecting ends ``failed``.

**Optional checks.** A backend that cannot do something declares it, and the kit then reports
that check as ``OPT-FAIL`` instead of failing the run (it still runs it, so the report shows what
happens). The declaration is an attribute ``conformance_optional`` (an iterable of check names)
on the factory's owner: the class for a ``classmethod`` factory (``MyBackend.create``), else the
factory itself::

    class MyBackend(RoomTableBackend):
        conformance_optional = frozenset({"link_error_sender", "link_error_receiver"})  # cannot tell

``run_conformance(..., optional={...})`` adds names for one run. ``roundtrip`` cannot be optional.

A backend given by registered name is built in each process from this process's registry (its
entry point); a factory must be importable by its ``__module__`` and ``__qualname__`` (not a
local function or a lambda), and its ``options`` a dataclass (rebuilt in the child from its
fields) or None.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from framework.testing.conformance_common import CheckFailed, CheckResult, ConformanceReport, display_name, run_check
from framework.testing.transfer_conformance_peer import GEOMETRY, MARK

__all__ = ["CHECKS", "CheckResult", "ConformanceReport", "assert_conformant", "declared_optional", "run_conformance"]

CHECKS = ("roundtrip", "timeout", "quiescence", "link_error_sender", "link_error_receiver")
NEVER_OPTIONAL = frozenset({"roundtrip"})
OPTIONAL_ATTR = "conformance_optional"
BIG_ROOM = (1 << 62) + 12345
# room -> (source pages on the sender, destination pages on the receiver, metadata)
ROUNDTRIP_ROOMS: dict[int, tuple[list[int], list[int], bytes]] = {
    11: ([1, 2, 3, 7], [4, 5, 6, 12], b"\x81\xa5token\x07"),  # two runs on the destination side
    12: ([9, 10], [2, 3], bytes(range(256)) * 4),  # 1 KiB of every byte value
    13: ([15], [1], b"x"),
    14: ([16, 4, 5, 6], [16, 8, 9, 10], b"\x00\x00"),
    BIG_ROOM: ([11], [11], b""),  # 63-bit room number, empty metadata
}


def declared_optional(factory: Any) -> frozenset[str]:
    """The checks the backend declares optional (``conformance_optional`` on the factory's owner)."""
    owner = getattr(factory, "__self__", factory)
    names = frozenset(getattr(owner, OPTIONAL_ATTR, ()) or ())
    unknown = names - set(CHECKS)
    if unknown:
        raise ValueError(f"{OPTIONAL_ATTR} names unknown checks {sorted(unknown)}; known: {', '.join(CHECKS)}")
    if names & NEVER_OPTIONAL:
        raise ValueError(f"{OPTIONAL_ATTR}: {', '.join(sorted(names & NEVER_OPTIONAL))} cannot be optional")
    return names


# -- the two processes -------------------------------------------------------------------------------


def _import_path(obj: Any) -> str:
    owner = getattr(obj, "__self__", None)
    if isinstance(owner, type):  # a classmethod, maybe inherited: look it up on the class it was taken from
        module, qualname = owner.__module__, f"{owner.__qualname__}.{obj.__name__}"
    else:
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        raise ValueError(
            f"{obj!r} cannot be rebuilt in the peer processes: pass a registered backend name, or a factory "
            "defined at module level in an importable module (not a lambda, a local function or __main__)"
        )
    return f"{module}:{qualname}"


def _spec(backend: str | Callable[..., Any], options: Any, device: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"device": device}
    if isinstance(backend, str):
        spec["name"] = backend
        if dataclasses.is_dataclass(options) and not isinstance(options, type):
            options = dataclasses.asdict(options)
        spec["options"] = dict(options) if options is not None else None
        return spec
    spec["factory"] = _import_path(backend)
    if options is not None:
        if not (dataclasses.is_dataclass(options) and not isinstance(options, type)):
            raise ValueError("options of a factory must be a dataclass instance (or None)")
        spec["options_cls"] = _import_path(type(options))
        spec["options"] = dataclasses.asdict(options)
    return spec


class _Peer:
    """One child process and its line protocol."""

    def __init__(self, role: str, spec: dict[str, Any], python: str, env: Mapping[str, str] | None) -> None:
        self.role = role
        self._stderr = tempfile.TemporaryFile(mode="w+b")
        child_env = dict(os.environ if env is None else env)
        paths = [p or os.getcwd() for p in sys.path if not p or os.path.isdir(p)]
        child_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*paths, child_env.get("PYTHONPATH", "")]))
        child_env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen(
            [python, "-m", "framework.testing.transfer_conformance_peer", role, json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=child_env,
        )
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._seq = 0
        """Id of the last command sent; answers carry it, so a late answer to a command that timed
        out is never taken for the answer to the next one."""
        threading.Thread(target=self._read, name=f"conformance-{role}", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._lines.put(json.loads(line[len(MARK):]))
        self._lines.put(None)

    def stderr_tail(self, chars: int = 3000) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-chars:]

    def send(self, cmd: str, **kwargs: Any) -> None:
        assert self.proc.stdin is not None
        self._seq += 1
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, "id": self._seq, **kwargs}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise CheckFailed(f"the {self.role} process is gone ({exc}); its stderr:\n{self.stderr_tail()}") from exc

    def reply(self, what: str, timeout_s: float) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while True:
            try:
                msg = self._lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise CheckFailed(f"the {self.role} process did not answer {what} within {timeout_s:g} s; "
                                  f"its stderr:\n{self.stderr_tail()}") from None
            if msg is None or msg.get("id", 0) == self._seq:
                break
        if msg is None:
            self.proc.wait(timeout=10)
            raise CheckFailed(f"the {self.role} process exited ({self.proc.returncode}) during {what}; "
                              f"its stderr:\n{self.stderr_tail()}")
        if not msg.get("ok"):
            raise CheckFailed(f"{self.role} side, {what}: the backend raised\n{msg.get('error')}")
        return msg

    def call(self, cmd: str, timeout_s: float = 60.0, **kwargs: Any) -> dict[str, Any]:
        self.send(cmd, **kwargs)
        return self.reply(cmd, timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("close")
                self.proc.wait(timeout=15)
            except (CheckFailed, subprocess.TimeoutExpired):
                pass
        self.kill()
        self._stderr.close()


class _Pair:
    """A sender and a receiver process, linked."""

    def __init__(self, spec: dict[str, Any], python: str, env: Mapping[str, str] | None, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self.tx = _Peer("prefill", spec, python, env)
        self.rx = _Peer("decode", spec, python, env)
        try:
            # Importing torch and building the backends can take a while on a busy machine.
            tx_ep = self.tx.reply("startup (building the backend)", 120)["endpoint"]
            rx_ep = self.rx.reply("startup (building the backend)", 120)["endpoint"]
            self.tx.send("connect", peer=rx_ep)
            self.rx.send("connect", peer=tx_ep)
            self.tx.reply("connect", deadline_s)
            self.rx.reply("connect", deadline_s)
        except BaseException:
            self.close()
            raise

    def both(self, tx: tuple[str, dict[str, Any]], rx: tuple[str, dict[str, Any]],
             timeout_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """Send a command to each side, then wait for both answers (they run concurrently)."""
        self.tx.send(tx[0], **tx[1])
        self.rx.send(rx[0], **rx[1])
        return self.tx.reply(tx[0], timeout_s), self.rx.reply(rx[0], timeout_s)

    def close(self, graceful: bool = True) -> None:
        """``close()`` both backends and let the processes exit; not ``graceful``: kill them (after
        a link check, where closing a backend whose peer is dead may wait on its own timeouts)."""
        for peer in (getattr(self, "tx", None), getattr(self, "rx", None)):
            if peer is None:
                continue
            if graceful:
                peer.close()
            else:
                peer.kill()
                peer._stderr.close()


# -- the checks (this process's side) --------------------------------------------------------------

_RANK = {"bootstrapping": 0, "waiting_for_input": 1, "transferring": 2, "success": 3, "failed": 3}


def _check_states(side: str, room: int, seen: dict[str, Any], want: str = "success") -> None:
    states = seen["states"]
    ranks = [_RANK[s] for s in states]
    if any(b <= a for a, b in zip(ranks, ranks[1:], strict=False)):
        raise CheckFailed(f"{side} room {room}: states went {' -> '.join(states)} (backwards or repeated)")
    if states[-1] != want:
        error = f" ({seen.get('error')})" if seen.get("error") else ""
        raise CheckFailed(f"{side} room {room}: ended {states[-1]}{error}, expected {want} "
                          f"(states seen: {' -> '.join(states)})")


def _transfer(pair: _Pair, rooms: Mapping[int, tuple[list[int], list[int], bytes]], maybe: Iterable[int] = ()) -> str:
    """Expect, send, wait for success on both sides, verify bytes and metadata, release."""
    dl = pair.deadline_s
    for room, (_src, dst, _meta) in rooms.items():
        pair.rx.call("expect", room=room, pages=dst)
    for room, (src, dst, meta) in rooms.items():
        pair.tx.call("send", room=room, src=src, dst=dst, meta=meta.hex())
    ids = list(rooms)
    tx, rx = pair.both(("wait_final", {"rooms": ids, "deadline_s": dl}),
                       ("wait_final", {"rooms": ids, "deadline_s": dl}), dl + 30)
    for room in ids:
        _check_states("sender", room, tx["rooms"][str(room)])
        _check_states("receiver", room, rx["rooms"][str(room)])
    pairs = [(s, d) for src, dst, _ in rooms.values() for s, d in zip(src, dst, strict=True)]
    got = pair.rx.call("verify_receiver", pairs=pairs, maybe=list(maybe),
                       metadata={str(r): m.hex() for r, (_s, _d, m) in rooms.items()})
    problems = got["problems"]
    problems += pair.tx.call("verify_sender")["problems"]
    if problems:
        raise CheckFailed("\n".join(problems[:12]) + (f"\n... {len(problems) - 12} more" if len(problems) > 12 else ""))
    for room in ids:
        pair.tx.call("release", room=room)
        pair.rx.call("release", room=room)
    return f"{len(ids)} rooms, {len(pairs)} pages x {GEOMETRY['num_layers'] * 2} buffers byte-exact"


def _roundtrip(pair: _Pair) -> str:
    detail = _transfer(pair, ROUNDTRIP_ROOMS)
    for peer in (pair.tx, pair.rx):
        peer.call("release", room=987654)  # an unknown room: a no-op
    return detail + ", metadata and states ok"


def _timeout(pair: _Pair, timeout_s: float) -> str:
    dl = pair.deadline_s
    room = 31
    pair.rx.call("expect", room=room, pages=[15])
    seen = pair.rx.call("observe", room=room, seconds=timeout_s, timeout_s=timeout_s + 30)["states"]
    early = [s for s in seen if s in ("transferring", "success", "failed")]
    if early:
        raise CheckFailed(f"a room that was never sent went {' -> '.join(seen)} within {timeout_s:g} s")
    got = pair.rx.call("expire", room=room, after_s=timeout_s)
    if not got["failed"] or got["poll_state"] != "failed":
        raise CheckFailed(f"check_timeout({timeout_s:g} s) after {timeout_s:g} s: returned {got['failed']}, "
                          f"poll() says {got['poll_state']} (expected failed)")
    pair.rx.call("release", room=room)
    q = pair.rx.call("quiescent", room=room, deadline_s=dl, timeout_s=dl + 30)
    if not q["quiescent"]:
        raise CheckFailed(f"the timed-out room was not quiescent {dl:g} s after its release")
    after = _transfer(pair, {32: ([3, 4], [14, 15], b"after a timeout")})
    return f"pending {' -> '.join(seen)} for {timeout_s:g} s, then failed ({got['error']}); next room: {after}"


def _quiescence(pair: _Pair) -> str:
    dl = pair.deadline_s
    pair.rx.call("expect", room=21, pages=[13, 14])
    pair.tx.call("send", room=21, src=[12, 13], dst=[13, 14], meta=b"released".hex())
    pair.tx.call("release", room=21)
    tq = pair.tx.call("quiescent", room=21, deadline_s=dl, timeout_s=dl + 30)
    if not tq["quiescent"]:
        raise CheckFailed(f"sender: a room released right after send() was not quiescent after {dl:g} s")
    time.sleep(0.3)  # whatever the sender still sent for room 21 lands (or not) now
    pair.rx.call("release", room=21)
    rq = pair.rx.call("quiescent", room=21, deadline_s=dl, timeout_s=dl + 30)
    if not rq["quiescent"]:
        raise CheckFailed(f"receiver: a released room was not quiescent after {dl:g} s")
    pair.rx.call("expect", room=23, pages=[5])
    pair.rx.call("release", room=23)
    if not pair.rx.call("quiescent", room=23, deadline_s=dl, timeout_s=dl + 30)["quiescent"]:
        raise CheckFailed("receiver: a room released before anything was sent was not quiescent")
    # Room 21's pages may or may not have landed: they are excluded from the untouched-pages check.
    after = _transfer(pair, {22: ([8], [7], b"after a release")}, maybe=[13, 14])
    return (f"sender quiescent after {tq['waited_s']:.2f} s, receiver after {rq['waited_s']:.2f} s; "
            f"next room: {after}")


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _link_error_sender(pair: _Pair, deadline_s: float) -> str:
    pair.rx.kill()
    got = pair.tx.call("link_error", deadline_s=deadline_s, probe=True, timeout_s=deadline_s + 30)
    if not got["link_error"]:
        raise CheckFailed(f"the receiver process was killed; link_error() still None after {deadline_s:g} s "
                          f"({got['probes']} rooms sent meanwhile, their states: {got['probe_states']})")
    return f"after {got['waited_s']:.2f} s: {_short(got['link_error'])}"


def _link_error_receiver(spec: dict[str, Any], python: str, env: Mapping[str, str] | None, deadline_s: float,
                         transfer_deadline_s: float) -> str:
    pair = _Pair(spec, python, env, transfer_deadline_s)
    try:
        _transfer(pair, {41: ([1], [2], b"up")})  # the link works
        pair.rx.call("expect", room=42, pages=[3])
        pair.tx.kill()
        got = pair.rx.call("link_error", deadline_s=deadline_s, probe=False, timeout_s=deadline_s + 30)
        if not got["link_error"]:
            raise CheckFailed(f"the sender process was killed; link_error() still None after {deadline_s:g} s")
        end = pair.rx.call("wait_final", rooms=[42], deadline_s=transfer_deadline_s,
                           timeout_s=transfer_deadline_s + 30)["rooms"]["42"]
        _check_states("receiver", 42, end, want="failed")
        return f"after {got['waited_s']:.2f} s: {_short(got['link_error'])}; the pending room failed"
    finally:
        pair.close(graceful=False)


def run_conformance(
    backend: str | Callable[..., Any],
    options: Any = None,
    *,
    device: str = "cpu",
    checks: Iterable[str] = CHECKS,
    optional: Iterable[str] = (),
    deadline_s: float = 30.0,
    timeout_s: float = 1.0,
    link_error_deadline_s: float = 15.0,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
) -> ConformanceReport:
    """Check a transfer backend between two processes and report per check.

    ``backend`` is a registered transfer backend name or its factory
    (``factory(role, kv_layout, options)``, importable by the child processes); ``options`` a
    mapping or dataclass for a name, a dataclass (or None) for a factory. ``device`` is where both
    KV caches live (``cuda`` for VRAM transfers). ``deadline_s`` bounds each transfer and
    quiescence wait, ``timeout_s`` is the bootstrap timeout the ``timeout`` check applies, and
    ``link_error_deadline_s`` how long a killed peer may take to show in ``link_error()``.
    ``optional`` adds check names to the ones the backend declares optional."""
    asked = set(checks)
    wanted = [c for c in CHECKS if c in asked]
    unknown = asked - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown transfer checks {sorted(unknown)}; known: {', '.join(CHECKS)}")
    if isinstance(backend, str):
        from framework.plugins import get_registry

        factory = get_registry().get("transfer_backend", backend, key="disaggregation.transfer_backend").factory
        name = backend
    else:
        factory, name = backend, display_name(backend)
    opt = declared_optional(factory) | frozenset(optional)
    if opt & NEVER_OPTIONAL:
        raise ValueError(f"{', '.join(sorted(opt & NEVER_OPTIONAL))} cannot be optional")
    spec = _spec(backend, options, device)
    report = ConformanceReport("transfer backend", name)
    in_pair = [c for c in wanted if c != "link_error_receiver"]
    if in_pair:
        start = time.monotonic()
        try:
            pair = _Pair(spec, python, env, deadline_s)
        except Exception as exc:
            detail = str(exc) if isinstance(exc, AssertionError) else f"raised {type(exc).__name__}: {exc}"
            for check in in_pair:
                report.results.append(CheckResult(check, False, f"the processes did not start or link: {detail}",
                                                  optional=check in opt, seconds=time.monotonic() - start))
            in_pair = []
        try:
            fns: dict[str, Callable[[], str]] = {
                "roundtrip": lambda: _roundtrip(pair),
                "timeout": lambda: _timeout(pair, timeout_s),
                "quiescence": lambda: _quiescence(pair),
                "link_error_sender": lambda: _link_error_sender(pair, link_error_deadline_s),
            }
            for check in in_pair:
                report.results.append(run_check(check, fns[check], optional=check in opt))
        finally:
            if in_pair:
                pair.close(graceful="link_error_sender" not in in_pair)
    if "link_error_receiver" in wanted:
        report.results.append(run_check(
            "link_error_receiver",
            lambda: _link_error_receiver(spec, python, env, link_error_deadline_s, deadline_s),
            optional="link_error_receiver" in opt,
        ))
    return report


def assert_conformant(backend: str | Callable[..., Any], options: Any = None, **kwargs: Any) -> ConformanceReport:
    """:func:`run_conformance`, raising ``AssertionError`` with every failing check if any fails."""
    return run_conformance(backend, options, **kwargs).raise_for_failures()
