"""The agent's watch (AgentPaths.WATCH): a request held on the control plane the beats go
to, answered as soon as this node's assignments differ from the revision of its last
heartbeat answer, so the node learns of a new replica at once and not a heartbeat later.

It runs on a thread and a client of its own (a held request never delays a beat), only
while the control plane answers beats (while it is away, the beats' backoff alone
decides), and is off for good after a 404 (a control plane older than the watch): the
agent then learns its assignments at each heartbeat. When the watch says the assignments
changed it wakes the heartbeat loop and waits for the beat that brings them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from llmgw.agent.client import AgentClient
from llmgw.config import AgentConfig
from llmgw.errors import APIError

log = logging.getLogger("llmgw.agent")

# A watch that got no answer (the control plane restarts, say) is held again after this.
WATCH_RETRY_S = 2.0


class Watch:
    """config() is the agent's configuration as it is now, server() the control plane its
    beats go to, away() whether its beats go unanswered, ended() whether the node was
    removed. `woken` is set when the assignments changed; the beat clears it."""

    def __init__(self, config: Callable[[], AgentConfig], server: Callable[[], str],
                 away: Callable[[], bool], ended: Callable[[], bool], *,
                 on: bool = True) -> None:
        self.config, self.server, self.away, self.ended = config, server, away, ended
        self.on = on
        self.revision = ""  # the last heartbeat answer's ("" when it had none)
        self.woken = threading.Event()
        self._revised = threading.Condition()

    def revised_to(self, revision: str) -> None:
        """A beat's answer came with revision."""
        with self._revised:
            self.revision = revision
            self._revised.notify_all()

    def release(self) -> None:
        """Let a watch thread waiting for a beat look at its stop again."""
        with self._revised:
            self._revised.notify_all()

    def run(self, stop: threading.Event) -> None:
        """Hold watches until stop is set, the node is removed or the watch is off."""
        client: AgentClient | None = None
        try:
            while self.on and not stop.is_set() and not self.ended():
                with self._revised:
                    self._revised.wait_for(lambda: stop.is_set() or bool(
                        self.revision and not self.away()), timeout=1.0)
                    since = "" if self.away() else self.revision
                if not since or stop.is_set():
                    continue
                client = self._client(client)
                try:
                    answer = client.watch(since)
                except APIError as e:
                    if e.status == 404:
                        self.on = False
                        log.info("the control plane at %s has no watch (an older version): "
                                 "this node learns its assignments at each heartbeat",
                                 client.shown)
                        return
                    log.debug("the watch got no answer (%s); holding one again in %.0f s",
                              e, WATCH_RETRY_S)
                    stop.wait(WATCH_RETRY_S)
                    continue
                if answer.get("changed"):
                    self.woken.set()
                    self._until_revised_from(since, stop)
        finally:
            if client is not None:
                client.close()

    def _until_revised_from(self, since: str, stop: threading.Event) -> None:
        """Until a beat brought a revision other than since (or a heartbeat passed)."""
        with self._revised:
            self._revised.wait_for(lambda: stop.is_set() or self.revision != since,
                                   timeout=self.config().heartbeat_s)

    def _client(self, client: AgentClient | None) -> AgentClient:
        """The watch's client, moved to the control plane the beats go to now."""
        server = self.server()
        if client is None:
            # The beats' timeout for the connect (a frozen control plane is left as fast);
            # the answer itself is waited for as long as the control plane holds it.
            config = self.config()
            return AgentClient(server, config.tls, timeout=config.failover_timeout_s)
        if client.server != server.rstrip("/"):
            client.move_to(server)
        return client
