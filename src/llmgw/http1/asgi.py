"""The ASGI shapes the services' plain apps (the gateway, its metrics) take and give, and
the lifespan protocol's runner for a server of ours (`server`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("llmgw.http")


class Lifespan:
    """The app's lifespan protocol: startup before serving, shutdown after the drain. An
    app that does not speak it (it raises on the lifespan scope) is served without."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.messages: asyncio.Queue[Message] = asyncio.Queue()
        self.said: asyncio.Queue[Message] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        try:
            await self.app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                           self.messages.get, self.said.put)
        except Exception:
            log.debug("the app has no lifespan", exc_info=True)
        await self.said.put({"type": "lifespan.gone"})

    async def startup(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())
        await self.messages.put({"type": "lifespan.startup"})
        said = await self.said.get()
        if said["type"] == "lifespan.startup.failed":
            raise RuntimeError(f"the app failed to start: {said.get('message', '')}")

    async def shutdown(self) -> None:
        if self.task is None or self.task.done():
            return
        await self.messages.put({"type": "lifespan.shutdown"})
        await self.said.get()
        await self.task
