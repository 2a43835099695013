"""Rank 0 of a decode server talking to a prefill server's bootstrap service.

Only rank 0 of the decode side makes HTTP calls; what it learns becomes part of the decision the
ranks agree on (``framework.disaggregation.decode_side``). Linking is three agreed steps, each
taken by :meth:`PrefillPeer.link_step` once the previous one is visible:

1. *prepare*: every prefill rank is registered (its TP rank, size, KV heads and model identity);
   the model identities match (else the queued rooms are refused, with the reason posted to the
   prefill side too); every decode rank builds its links for the prefill side's heads;
2. *register*: rank 0 registers every decode rank's link endpoints under this side's session;
3. *connect*: every prefill rank advertises this session as accepted, with its own links'
   endpoints; every decode rank connects its links.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import httpx

from framework.disaggregation.bootstrap import BootstrapClient
from framework.disaggregation.common import registration
from framework.disaggregation.heads import ModelIdentity, RankShard, all_shards

logger = logging.getLogger(__name__)

CONNECT_RETRY_S = 0.05
"""How often a queued request retries reaching the bootstrap service (an HTTP call each)."""
PEER_CHECK_S = 1.0
"""How often, while requests queue, the prefill endpoint is re-read to notice a restarted peer
whose death the links did not report."""
LOOKUP_TIMEOUT_S = 0.25
"""Timeout of an endpoint lookup from the scheduler loop: a hung (e.g. stopped) prefill server must
not stall the running decodes for the client's full timeout."""
UNREACHABLE_RETRY_S = 0.5
"""Back-off after a failed lookup."""


class PrefillPeer:
    """Rank 0's bootstrap clients, this side's session, and room posts that failed."""

    def __init__(self, identity: ModelIdentity | None, shard: RankShard) -> None:
        assert identity is not None
        self.identity, self.shard = identity, shard
        self.clients: dict[tuple[str, int], BootstrapClient] = {}
        self.session = uuid.uuid4().hex
        self.peer_session: str | None = None
        """The prefill ``pd_session`` the links were prepared for."""
        self.addr: tuple[str, int] | None = None
        self._post_errors: dict[int, str] = {}
        self._next_try = 0.0
        self._next_check = 0.0

    def client(self, addr: tuple[str, int]) -> BootstrapClient:
        return self.clients.setdefault(addr, BootstrapClient(*addr, timeout_s=2.0))

    def new_session(self) -> None:
        """After a reset: register anew, so the prefill side builds fresh links."""
        self.session, self.peer_session, self.addr = uuid.uuid4().hex, None, None

    def take_post_errors(self) -> dict[int, str]:
        errors, self._post_errors = self._post_errors, {}
        return errors

    def post_room(self, addr: tuple[str, int], room: int, dst_pages: list[int]) -> None:
        try:
            self.client(addr).post_room(room, dst_pages)
        except httpx.HTTPError as exc:
            self._post_errors[room] = f"posting the destination to the bootstrap service failed: {exc}"

    def check_alive(self, queued: bool) -> str | None:
        """While requests queue, re-read the prefill endpoint now and then: why the link is gone
        (the prefill server restarted or dropped it), or None."""
        now = time.monotonic()
        if not queued or now < self._next_check or self.addr is None:
            return None
        self._next_check = now + PEER_CHECK_S
        try:
            first = self.client(self.addr).endpoints("prefill", LOOKUP_TIMEOUT_S).get(0)
        except httpx.HTTPError:
            return None  # down or busy: the links or the timeouts will tell
        if first is None:
            return None
        if first.get("pd_session") != self.peer_session:
            return "the prefill server restarted"
        if first.get("pd_peer_session") != self.session:
            return "the prefill server dropped this link"
        return None

    def link_step(self, addr: tuple[str, int], linked_to: tuple[str, int] | None, advertised: bool,
                  endpoints: list[dict[str, Any] | None], rooms: list[int]) -> dict[str, Any]:
        """The next linking step towards the prefill bootstrap at ``addr`` (see the module
        docstring), as part of the decision; ``endpoints``: each decode rank's link endpoints
        (None until built); ``rooms``: the queued rooms for ``addr``."""
        now = time.monotonic()
        if now < self._next_try:
            return {}
        self._next_try = now + CONNECT_RETRY_S
        try:
            return self._link_step(addr, linked_to, advertised, endpoints, rooms)
        except httpx.HTTPError as exc:
            logger.debug("bootstrap %s:%d not reachable yet: %s", *addr, exc)
            self._next_try = now + UNREACHABLE_RETRY_S
            return {}

    def _link_step(self, addr: tuple[str, int], linked_to: tuple[str, int] | None, advertised: bool,
                   endpoints: list[dict[str, Any] | None], rooms: list[int]) -> dict[str, Any]:
        eps = self.client(addr).endpoints("prefill", LOOKUP_TIMEOUT_S)
        first = eps.get(0)
        if first is None or "shard" not in first:
            return {}
        size = int(first["shard"]["tp_size"])
        if any(r not in eps or eps[r].get("pd_session") != first.get("pd_session") for r in range(size)):
            return {}  # a prefill rank is missing or still from an earlier start
        why = self.identity.mismatch(ModelIdentity.from_json(first["identity"])) if first.get("identity") else None
        if why:
            error = f"the prefill server at {addr[0]}:{addr[1]} holds a different model's KV ({why})"
            for room in rooms:
                try:
                    self.client(addr).post_error(room, error)
                except httpx.HTTPError:
                    pass  # its own bootstrap timeout fails it there
            return {"refuse": {"addr": list(addr), "error": error}}
        if linked_to != addr or self.peer_session != first.get("pd_session"):
            self.peer_session, self.addr = first.get("pd_session"), addr
            return {"prepare": {"addr": list(addr), "peers": [eps[r]["shard"] for r in range(size)]}}
        if not advertised:
            if any(e is None for e in endpoints):
                return {}
            for shard, links in zip(all_shards(self.identity.num_kv_heads, self.shard.tp_size), endpoints,
                                    strict=True):
                self.client(addr).register("decode", shard.tp_rank,
                                           registration(shard, self.identity, self.session, None, links or {}))
            return {"advertised": True}
        if all(eps[r].get("pd_peer_session") == self.session for r in range(size)):
            self._next_check = time.monotonic() + PEER_CHECK_S
            logger.info("linking to prefill session %s at %s:%d (%d ranks)", first.get("pd_session"), *addr, size)
            return {"connect": {r: eps[r].get("links") or {} for r in range(size)}}
        return {}

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
