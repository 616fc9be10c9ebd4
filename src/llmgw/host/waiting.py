"""Waits that say what they waited for and the last state they saw."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed

from llmgw.errors import APIError, Error


class WaitTimeout(Error, AssertionError):
    """A wait ran out; the message names what it waited for and the last state seen.

    An AssertionError too, so a harness promise that waits fails like any other check."""


@dataclass
class Probe:
    """One look at the world: whether it is there yet, and what was seen."""

    ok: bool
    seen: str


def wait_until(
    what: str,
    probe: Callable[[], Probe],
    *,
    timeout_s: float,
    interval_s: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> Probe:
    """Call probe until it is ok; raise WaitTimeout after timeout_s.

    A probe that raises stops the wait at once (a failed build does not wait 20 minutes).
    """
    last: list[Probe] = []

    def look() -> Probe:
        result = probe()
        last.append(result)
        return result

    retrying = Retrying(
        stop=stop_after_delay(timeout_s),
        wait=wait_fixed(interval_s),
        retry=retry_if_result(lambda p: not p.ok),
        sleep=sleep,
    )
    try:
        return retrying(look)
    except RetryError:
        seen = last[-1].seen if last else "nothing"
        raise WaitTimeout(
            f"gave up waiting for {what} after {timeout_s:.0f}s; last seen: {seen}; "
            "run again to keep waiting"
        ) from None


def through_api_errors(probe: Callable[[], Probe]) -> Callable[[], Probe]:
    """probe, with a transient API error (APIError.transient: no answer, or a 5xx) taken
    as one more look that is not there yet, showing the error as the state seen; any other
    error still ends the wait at once.

    A long wait (a 30-minute download, a replica starting) must outlast a restart of
    the service it polls.
    """

    def look() -> Probe:
        try:
            return probe()
        except APIError as e:
            if not e.transient:
                raise
            return Probe(False, f"{e} (will ask again)")

    return look
