"""wait_until: tenacity waits that say what they waited for and the last state seen."""

from __future__ import annotations

import pytest

from llmgw.errors import APIError
from llmgw.host.waiting import Probe, WaitTimeout, through_api_errors, wait_until


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_returns_once_the_probe_is_ok() -> None:
    seen = iter([Probe(False, "starting"), Probe(False, "loading"), Probe(True, "ready")])
    assert wait_until("x", lambda: next(seen), timeout_s=60, sleep=lambda s: None).seen == "ready"


def test_timeout_names_what_and_the_last_state(monkeypatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr("time.monotonic", lambda: clock.now)
    states = iter(f"state {i}" for i in range(1000))
    with pytest.raises(WaitTimeout) as err:
        wait_until("the replica to be ready", lambda: Probe(False, next(states)),
                   timeout_s=5, interval_s=1, sleep=clock.sleep)
    message = str(err.value)
    assert "the replica to be ready" in message and "after 5s" in message
    assert "last seen: state 5" in message and "run again to keep waiting" in message


def test_a_probe_that_raises_stops_at_once() -> None:
    calls = []

    def probe() -> Probe:
        calls.append(1)
        raise AssertionError("the build failed: no compiler")

    with pytest.raises(AssertionError, match="no compiler"):
        wait_until("x", probe, timeout_s=600, sleep=lambda s: None)
    assert len(calls) == 1


def test_a_long_wait_polls_through_a_service_restart() -> None:
    """No answer (status None) and 5xx are one more look; the last state seen names it."""

    answers = iter([APIError("connection refused", None), APIError("busy", 503),
                    Probe(True, "present")])

    def probe() -> Probe:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    seen = []
    wrapped = through_api_errors(probe)
    for _ in range(3):
        seen.append(wrapped())
    assert [p.ok for p in seen] == [False, False, True]
    assert seen[0].seen == "connection refused (will ask again)"


def test_a_refusal_still_ends_the_wait() -> None:

    def probe() -> Probe:
        raise APIError("no such model", 404)

    with pytest.raises(APIError, match="no such model"):
        wait_until("x", through_api_errors(probe), timeout_s=60, sleep=lambda s: None)


def test_a_wait_that_runs_out_shows_the_error_as_the_last_state(monkeypatch) -> None:

    clock = FakeClock()
    monkeypatch.setattr("time.monotonic", lambda: clock.now)

    def probe() -> Probe:
        raise APIError("GET /health: connection refused", None)

    with pytest.raises(WaitTimeout, match="last seen: GET /health: connection refused"):
        wait_until("the mirror", through_api_errors(probe), timeout_s=5, interval_s=1,
                   sleep=clock.sleep)
