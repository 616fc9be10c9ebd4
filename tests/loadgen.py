"""A bounded load of keep-alive clients through a gateway, every other request a stream,
counting what was not answered in full: for the tests of restarts that must lose none."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CLIENTS = 6
PER_CLIENT = 3000  # a bound on the load; the load stops when the test says so, long before
LOAD_LIMIT_S = 60.0


def until(what: str, ok: Callable[[], object], log: Callable[[], str] = lambda: "",
          timeout_s: float = 30.0, interval_s: float = 0.1,
          catching: tuple[type[Exception], ...] = (httpx.HTTPError,)) -> None:
    """Until ok() is true; a wait that runs out says what it waited for, the last error
    ok() raised (of those caught) and what log() says then (a log's end, a state)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            if ok():
                return
        except catching as e:
            last = repr(e)
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last seen: "
                         f"{last or '(no error)'}; then: {log()}")


@dataclass
class Load:
    """`clients` (CLIENTS) keep-alive clients calling the gateway back to back, every
    other request a stream; bounded in count (PER_CLIENT each) and time (LOAD_LIMIT_S)."""

    url: str
    body: dict[str, object] = field(default_factory=lambda: dict(CHAT))
    # The gateway key sent as the bearer token ("" for an open gateway).
    key: str = ""
    clients: int = CLIENTS
    # The bounds of each client: requests, and seconds from the start.
    per_client: int = PER_CLIENT
    limit_s: float = LOAD_LIMIT_S
    done: int = 0
    answered: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> Load:
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in
                        range(self.clients)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(self.limit_s)

    def _client(self, i: int) -> None:
        deadline = time.monotonic() + self.limit_s
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        with httpx.Client(base_url=self.url, timeout=30, headers=headers) as client:
            for n in range(self.per_client):
                if self.stop.is_set() or time.monotonic() > deadline:
                    return
                failure = one_request(client, self.body, stream=(i + n) % 2 == 1)
                with self.lock:
                    self.done += 1
                    self.answered += not failure
                    if failure:
                        self.failures.append(failure)
                if failure:
                    time.sleep(0.05)  # a refused connection returns at once: do not spin

    def wait_for(self, more: int) -> None:
        """Until `more` further requests were answered in full."""
        count = self.answered + more
        until(f"{count} whole answers under load", lambda: self.answered >= count,
              lambda: self._state(), 60)

    def _state(self) -> str:
        running = sum(t.is_alive() for t in self.threads)
        return (f"{running} of {self.clients} clients still running (each stops after "
                f"{self.per_client} requests or {self.limit_s:g} s); {self.done} done, "
                f"last failures: {self.failures[-3:]}")


def one_request(client: httpx.Client, body: dict[str, object], stream: bool) -> str:
    """'' when the gateway answered in full (a stream: up to its [DONE]); else what went
    wrong."""
    try:
        if not stream:
            r = client.post("/v1/chat/completions", json=body)
            return "" if r.status_code == 200 else f"{r.status_code}: {r.text[:200]}"
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            text = "".join(r.iter_text())
        if r.status_code != 200:
            return f"stream {r.status_code}: {text[:200]}"
        if "data: [DONE]" in text:
            return ""
        last = text.rstrip().rpartition("data: ")[2]
        if last.startswith('{"error"'):  # the gateway's word for a replica that broke off
            return f"a stream broke off: {json.loads(last)['error']['message']}"
        return f"a stream ended without [DONE]: {text[-200:]}"
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
