"""The control planes an agent knows: agent.yaml's `server` first, then those learned."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from llmgw.errors import shown_url
from llmgw.host.files import atomic_write

log = logging.getLogger("llmgw.agent")

# In the agent's state dir: what it learned, and the one it last reached.
FILE = "control-planes.json"


def _url(raw: object) -> str:
    """raw as a control plane's URL (no trailing slash), or "" when it is none."""
    return raw.rstrip("/") if isinstance(raw, str) and raw.startswith("https://") else ""


class ControlPlanes:
    """The agent API URLs this node may heartbeat to, and the one it uses now.

    The first is agent.yaml's `server`; the others are what the last heartbeat answer that
    carried `control_planes` named. Both that list and the current URL are kept in
    state_dir/control-planes.json (an atomic write), so a restarted agent still knows them;
    a file that cannot be read is ignored, with a warning.
    """

    def __init__(self, server: str, state_dir: str | Path) -> None:
        self.server = _url(server) or server.rstrip("/")
        self.path = Path(state_dir) / FILE
        self.learned: list[str] = []
        self.current = self.server
        self._load()

    @property
    def urls(self) -> list[str]:
        """agent.yaml's server, then each learned one not already named."""
        return list(dict.fromkeys([self.server, *self.learned]))

    def next_after(self, url: str) -> str:
        """The URL after url in urls, round to the first; url itself when it is alone."""
        urls = self.urls
        at = urls.index(url) if url in urls else -1
        return urls[(at + 1) % len(urls)]

    def use(self, url: str) -> None:
        """Make url the current one, and keep that."""
        if url != self.current:
            self.current = url
            self._save()

    def learn(self, answer: object) -> bool:
        """Take the list a heartbeat answer's `control_planes` names; an answer without one
        (an older control plane) keeps what was known. Returns whether the list changed."""
        if not isinstance(answer, dict) or not isinstance(answer.get("control_planes"), list):
            return False
        learned = list(dict.fromkeys(u for u in map(_url, answer["control_planes"]) if u))
        if not learned or learned == self.learned:
            return False
        self.learned = learned
        self._save()
        log.info("control planes known: %s", ", ".join(map(shown_url, self.urls)))
        return True

    def _load(self) -> None:
        try:
            kept = json.loads(self.path.read_text())
            learned = kept["learned"]
            current = kept.get("current", "")
            if not isinstance(learned, list) or not isinstance(current, str):
                raise ValueError("learned is not a list of URLs, or current not a URL")
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring %s, which does not hold the control planes this agent "
                        "learned (%s); starting from agent.yaml's server %s, and the next "
                        "heartbeat answer writes it again", self.path, e, self.server)
            return
        self.learned = [u for u in map(_url, learned) if u]
        self.current = _url(current) if _url(current) in self.urls else self.server

    def _save(self) -> None:
        body = {"current": self.current, "learned": self.learned}
        try:
            atomic_write(self.path, json.dumps(body, indent=1) + "\n", mode=0o644)
        except OSError as e:
            log.warning("cannot keep the control planes in %s: %s; a restarted agent will "
                        "know only agent.yaml's server", self.path, e)


def current_server(server: str, state_dir: str | Path) -> str:
    """The control plane the agent on this machine last reached (agent.yaml's server until
    it has moved): where another process of this node (`llmgw check --serve`) sends."""
    return ControlPlanes(server, state_dir).current
