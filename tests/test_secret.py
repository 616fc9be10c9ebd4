"""The one secret type (contract/secret.py): its shapes, the hash kept of it (the format that
existing keys, tokens and cookies were stored in) and the constant-time check."""

from __future__ import annotations

import hashlib

from llmgw.contract.secret import Secret, digest, matches, same_hash


def test_a_kinded_secret_is_kind_id_dash_random_and_a_bare_one_the_random_part() -> None:
    key = Secret.new("sk-llmgw-")
    assert len(key.id) == 8 and int(key.id, 16) >= 0 and len(key.random) == 43
    assert key.prefix == f"sk-llmgw-{key.id}" and key.text == f"{key.prefix}-{key.random}"
    bare = Secret.new()
    assert bare.id == "" and bare.prefix == "" and bare.text == bare.random
    assert len(bare.random) == 43 and Secret.new().text != bare.text


def test_the_hash_kept_is_the_sha256_of_the_whole_text_in_hex() -> None:
    made = Secret("vk-llmgw-", "0123abcd", "r" * 43)
    assert made.hash == hashlib.sha256(b"vk-llmgw-0123abcd-" + b"r" * 43).hexdigest()
    assert digest("abc") == digest(b"abc") == hashlib.sha256(b"abc").hexdigest()


def test_matches_takes_the_secret_and_refuses_another_or_no_hash() -> None:
    made = Secret.new()
    assert matches(made.text, made.hash)
    assert not matches(made.text + "x", made.hash), "negative control: another secret"
    assert not matches(made.text, ""), "no hash to check against takes nothing"


def test_same_hash_refuses_a_hash_file_of_other_text_without_raising() -> None:
    assert same_hash(digest("a"), digest("a")) and not same_hash(digest("a"), digest("b"))
    assert not same_hash(digest("a"), "é" * 64)
