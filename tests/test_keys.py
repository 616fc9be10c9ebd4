"""Gateway keys' pure logic: the format, reading a bearer credential, expiry dates, names
(the per-minute windows and the usage batches: gateway/test_limits.py)."""

from __future__ import annotations

import datetime as dt
import hashlib

import pytest

from llmgw.contract import keys, secret


def test_a_new_key_has_its_shape_and_only_its_hash_is_derived() -> None:
    made = keys.new_key()
    text = made.text.encode()
    assert keys.is_key_shaped(text) and text.startswith(made.prefix.encode())
    # What stores hold for existing keys: the sha256 of the whole key, in hex.
    assert len(made.id) == 8 and made.hash == hashlib.sha256(text).hexdigest()
    assert made.random not in made.hash and made.hash != secret.digest(made.random)
    assert keys.new_key().text != made.text


@pytest.mark.parametrize("presented", [
    b"", b"sk-llmgw-", b"sk-llmgw-0123abcd-short", b"sk-llmgw-0123ABCD-" + b"a" * 43,
    b"sk-llmgw-0123abcd-" + b"a" * 44, b"sk-llmgw-0123abcd-" + b"a" * 42 + b"\xc3\xa9",
    b"sk-llmgw-0123abcd-" + b"a" * 42 + b"=", b" sk-llmgw-0123abcd-" + b"a" * 43,
])
def test_malformed_and_non_ascii_credentials_are_not_key_shaped(presented: bytes) -> None:
    assert not keys.is_key_shaped(presented)


def test_the_bearer_credential_none_when_absent_empty_for_another_scheme() -> None:
    assert keys.bearer([]) is None
    assert keys.bearer([(b"authorization", b"Basic abc")]) == b""
    assert keys.bearer([(b"authorization", b"BEARER   abc ")]) == b"abc"
    assert keys.bearer([(b"x", b"y"), (b"authorization", b"bearer k\xe9")]) == b"k\xe9"


def test_expires_takes_dates_times_and_spans_and_refuses_the_past() -> None:
    now = dt.datetime(2026, 12, 2, tzinfo=dt.UTC).timestamp()
    end_of_day = dt.datetime(2027, 2, 1, tzinfo=dt.UTC).timestamp()
    assert keys.parse_expires("2027-01-31", now) == end_of_day
    assert keys.parse_expires("2027-01-31T12:00:00+01:00", now) == end_of_day - 13 * 3600
    assert keys.parse_expires("30d", now) == now + 30 * 86400
    assert keys.parse_expires("12h", now) == now + 12 * 3600
    for bad in ("2020-01-01", "tomorrow", "30y"):
        with pytest.raises(ValueError, match="--expires"):
            keys.parse_expires(bad, now)


def test_names_are_short_and_plain() -> None:
    assert keys.check_name("ci-bot@team.x") == "ci-bot@team.x"
    for bad in ("", "-x", "a b", "é", "x" * 65):
        with pytest.raises(ValueError, match="not allowed"):
            keys.check_name(bad)
