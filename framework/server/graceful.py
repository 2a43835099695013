"""uvicorn's server with a shutdown that ends every open request with a well-formed answer.

On SIGTERM / Ctrl-C uvicorn stops accepting connections and waits for the open ones; after its
``timeout_graceful_shutdown`` it cancels whatever still runs, and a client then gets uvicorn's
plain-text 500 or a stream cut short. Here the drain is plugserve's own:

1. draining starts: new requests on open connections get a 503, uploads still arriving get a 503
   at once (:class:`~framework.server.request_guard.RequestGuard`), running requests continue;
2. after ``server.shutdown_timeout_s`` every request still open is ended by ``on_deadline``
   (the tokenizer manager's ``fail_all``: a 503, or in a stream the finish chunks, an error event
   and ``[DONE]``), and the scheduler frees their KV;
3. only if a route still has not returned :data:`FINAL_GRACE_S` later does uvicorn cancel it, and
   the request guard still answers in the API's shape.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

import uvicorn

from framework.server.request_guard import Lifecycle

logger = logging.getLogger("plugserve.server")

FINAL_GRACE_S = 5.0
"""After the grace period has ended every request, how long responses get to be written out."""


class GracefulServer(uvicorn.Server):
    """:class:`uvicorn.Server` whose shutdown drains as the module docstring says."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, grace_s: float,
                 on_deadline: Callable[[], Awaitable[int]]) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.grace_s = grace_s
        self.on_deadline = on_deadline

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.lifecycle.begin_drain()
        deadline = asyncio.get_running_loop().create_task(self._end_open_requests())
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _end_open_requests(self) -> None:
        await asyncio.sleep(self.grace_s)
        ended = await self.on_deadline()
        if ended:
            logger.warning("shutdown: %d request(s) still open after %.0fs (server.shutdown_timeout_s) were "
                           "ended with a 503", ended, self.grace_s)


def uvicorn_timeout(grace_s: float) -> int:
    """uvicorn's own ``timeout_graceful_shutdown``: the grace period plus the final one."""
    return max(1, int(grace_s + FINAL_GRACE_S + 0.999))
