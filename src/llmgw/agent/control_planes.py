"""The control planes an agent knows (agent.yaml's `server`, then those learned) and the one
its node beats to: a home picked by rendezvous hashing of the node id over their URLs."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from llmgw.errors import shown_url
from llmgw.host.files import atomic_write

log = logging.getLogger("llmgw.agent")

# In the agent's state dir: what it learned, and the one it last reached.
FILE = "control-planes.json"
# A node away from its home (it joined, or came back) returns after a delay of its own in
# [0, RETURN_SPREAD_S): a returning control plane's nodes come back over a minute, not at once.
RETURN_SPREAD_S = 60.0
# A home that did not answer is tried again no sooner than this, unless it leaves the
# answers' list and comes back into it (then it was restarted, and the spread above holds).
RETRY_HOME_S = 60.0


def _digest(text: str) -> int:
    """A 64-bit hash of text, the same in every process and on every machine (Python's
    hash() of a str is salted per process, so a restarted agent would pick anew)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def rendezvous(node_id: str, urls: list[str]) -> list[str]:
    """urls in node_id's rendezvous order (highest random weight first): the first is the
    node's home, the next where it goes when that one does not answer. Adding a control
    plane moves only the nodes whose first it becomes (about 1/N); removing one moves only
    those whose first it was."""
    return sorted(dict.fromkeys(urls), key=lambda u: (-_digest(f"{u}\n{node_id}"), u))


def return_delay_s(node_id: str, spread_s: float = RETURN_SPREAD_S) -> float:
    """How long node_id waits, once its home differs from where it beats, before it moves
    home: the same for the node in every process, spread evenly over [0, spread_s)."""
    return spread_s * _digest(f"return\n{node_id}") / 2.0 ** 64


def _url(raw: object) -> str:
    """raw as a control plane's URL (no trailing slash), or "" when it is none."""
    return raw.rstrip("/") if isinstance(raw, str) and raw.startswith("https://") else ""


class ControlPlanes:
    """The agent API URLs this node may heartbeat to, the one it uses now, and its home.

    agent.yaml's `server`, and what the last heartbeat answer that carried `control_planes`
    named. Both that list and the current URL are kept in state_dir/control-planes.json (an
    atomic write), so a restarted agent still knows them; a file that cannot be read is
    ignored, with a warning.

    The home is the first of the learned URLs in node_id's rendezvous order: every control
    plane names the fleet's alike (each its own row's agent_url), so N of them each get about
    1/N of the nodes, and the same node picks the same home after any restart. URLs, not
    the control planes' ids: the URL is what an answer names and what the agent dials, and
    it stays while a control plane's config does, even if its state dir is made anew.
    """

    def __init__(self, server: str, state_dir: str | Path, node_id: str = "",
                 spread_s: float = RETURN_SPREAD_S) -> None:
        self.server = _url(server) or server.rstrip("/")
        self.path = Path(state_dir) / FILE
        self.node_id = node_id
        self.return_delay_s = return_delay_s(node_id, spread_s)
        self.learned: list[str] = []
        self.current = self.server
        # The home this node found itself away from, and since when (None: at home); when
        # each URL it left for not answering did so (forgotten once the URL leaves the list).
        self._away: tuple[str, float] | None = None
        self._failed: dict[str, float] = {}
        self._load()

    @property
    def urls(self) -> list[str]:
        """agent.yaml's server, then each learned one not already named."""
        return list(dict.fromkeys([self.server, *self.learned]))

    @property
    def order(self) -> list[str]:
        """Where this node beats, in turn: the learned URLs in its rendezvous order (agent.yaml's
        server alone before it learned any), then agent.yaml's server if not among them."""
        return list(dict.fromkeys([*rendezvous(self.node_id, self.learned or [self.server]),
                                   self.server]))

    @property
    def home(self) -> str:
        """The control plane this node beats to while it answers."""
        return self.order[0]

    def next_after(self, url: str) -> str:
        """The URL after url in order, round to the first; url itself when it is alone."""
        urls = self.order
        at = urls.index(url) if url in urls else -1
        return urls[(at + 1) % len(urls)]

    def use(self, url: str) -> None:
        """Make url the current one, and keep that."""
        if url != self.current:
            self.current = url
            self._save()

    def left(self, url: str, now: float) -> None:
        """url did not answer at now, and the node moved on: no move back to it before
        RETRY_HOME_S has passed (or it came back into the list)."""
        self._failed[url] = now

    def due_home(self, now: float) -> str | None:
        """The home to move to now, or None: at home already, or its return delay (counted
        from when this node found itself away, or from RETRY_HOME_S after home failed) has
        not yet passed."""
        home = self.home
        if home == self.current:
            self._away = None
            return None
        if self._away is None or self._away[0] != home:
            self._away = (home, now)
        start = max(self._away[1], self._failed.get(home, float("-inf")) + RETRY_HOME_S)
        return home if now >= start + self.return_delay_s else None

    def learn(self, answer: object) -> bool:
        """Take the list a heartbeat answer's `control_planes` names; an answer without one
        (an older control plane) keeps what was known. Returns whether the list changed."""
        if not isinstance(answer, dict) or not isinstance(answer.get("control_planes"), list):
            return False
        learned = list(dict.fromkeys(u for u in map(_url, answer["control_planes"]) if u))
        if not learned or learned == self.learned:
            return False
        self.learned = learned
        # One that left the list and comes back was restarted: its nodes may return to it.
        self._failed = {u: t for u, t in self._failed.items() if u in learned}
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
