"""A key's shares as one gateway holds them (pure logic, times given): spent without the
store while they last, the store asked when they are gone, a refusal believed for a
second, claims sized by the recent rate, debts for tokens, and with the store away only
this gateway's fraction of the limit, never the whole."""

from __future__ import annotations

import pytest

from llmgw.gateway._shares import ASK, RECHECK_S, SHARE_TTL_S, KeyShares, Share
from llmgw.store import Grant, Settled


def grant(shares: KeyShares, kind: str, amount: int, now: float, wanted: int | None = None,
          wait_s: float = 0.0, claim: int = 1) -> None:
    asked = amount if wanted is None else wanted
    share = shares.requests if kind == "requests" else shares.tokens
    assert share is not None
    share.granted(Grant(shares.key_id, kind, claim, amount, wait_s), asked, now)


def test_a_request_is_admitted_from_what_is_held_and_asks_the_store_when_none_is() -> None:
    shares = KeyShares("k", rpm=20, tpm=0)
    assert shares.admit(0.0, 0.0, 1, away=False) is ASK, "nothing held yet: ask the store"
    grant(shares, "requests", 2, 0.0)
    assert shares.admit(0.1, 0.1, 1, away=False) is None
    assert shares.admit(0.2, 0.2, 1, away=False) is None
    assert shares.admit(0.3, 0.3, 1, away=False) is ASK, "both spent: ask again"
    assert shares.requests is not None and shares.requests.spent.total == 2


def test_a_refusal_is_believed_for_a_second_with_the_stores_wait_then_asked_again() -> None:
    shares = KeyShares("k", rpm=20, tpm=0)
    grant(shares, "requests", 0, 0.0, wanted=3, wait_s=42.0)
    assert shares.admit(0.5, 0.5, 1, away=False) == ("requests", pytest.approx(41.5))
    assert shares.admit(RECHECK_S + 0.01, 1.0, 1, away=False) is ASK


def test_unspent_claims_lapse_and_are_settled_with_what_was_spent() -> None:
    shares = KeyShares("k", rpm=20, tpm=0)
    grant(shares, "requests", 3, 0.0, claim=7)
    assert shares.admit(1.0, 100.0, 1, away=False) is None
    assert shares.done(1.0) == [], "neither used up nor lapsed"
    assert shares.admit(SHARE_TTL_S + 0.1, 105.0, 1, away=False) is ASK, \
        "a lapsed claim's units are no longer this gateway's"
    assert shares.done(SHARE_TTL_S + 0.1) == [Settled(7, 1, 100.0)]


def test_tokens_go_while_one_is_left_and_what_an_answer_spends_beyond_is_a_debt() -> None:
    shares = KeyShares("k", rpm=0, tpm=100)
    tokens = shares.tokens
    assert tokens is not None
    grant(shares, "tokens", 10, 0.0)
    assert shares.admit(0.1, 0.1, 1, away=False) is None
    tokens.take(0.2, 0.2, 9)
    assert shares.admit(0.3, 0.3, 1, away=False) is None, "one token is left"
    tokens.take(0.4, 0.4, 8)
    assert tokens.held(0.5) == -7 and shares.admit(0.5, 0.5, 1, away=False) is ASK
    wants = shares.wants(0.5, 1)
    assert [(w.kind, w.forced) for w in wants] == [("tokens", 7)] and tokens.debt == 0
    shares.put_back(wants)
    assert tokens.debt == 7, "a debt the store could not take is kept for the next try"


def test_claims_ask_for_the_recent_rate_within_a_fraction_of_the_limit() -> None:
    share = Share("requests", 400)
    assert share.want(0.0, 1) == 1, "no rate yet: one"
    for t in range(30):
        share.take(t / 10, 0.0, 1)
    assert share.want(3.0, 1) == 19, "what the last 2 s spent (1.1 to 2.9)"
    for t in range(300):
        share.take(3.0 + t / 1000, 0.0, 1)
    assert share.want(3.3, 1) == 100 and share.want(3.3, 4) == 25, \
        "at most 1/(4 x gateways) of the limit"


def test_with_the_store_away_a_gateway_keeps_its_fraction_never_the_whole() -> None:
    shares = KeyShares("k", rpm=20, tpm=0)
    admitted = sum(shares.admit(t / 100, 0.0, 1, away=True) is None for t in range(40))
    assert admitted == 10, "alone as it last saw, it still keeps only half"
    shares = KeyShares("k", rpm=20, tpm=0)
    admitted = sum(shares.admit(t / 100, 0.0, 4, away=True) is None for t in range(40))
    assert admitted == 5, "one of the four gateways it last saw"
    over = shares.admit(1.0, 0.0, 4, away=True)
    assert over == ("requests", pytest.approx(59.0)), "the first of the five leaves at 60 s"
    assert shares.requests is not None and shares.requests.debt == 5, \
        "what it spent away is counted by force once the store answers"
    control = KeyShares("k", rpm=20, tpm=0)
    grant(control, "requests", 20, 0.0)
    assert sum(control.admit(t / 100, 0.0, 1, away=False) is None for t in range(40)) == 20, \
        "control: with the store there, a share of the whole minute is spent whole"
