"""The tests' tiny GGUF: every token is a whole character, so any answer is valid UTF-8."""

from __future__ import annotations

import gguf

from tests.tiny_gguf import _vocab


def _piece(token: str, kind: int) -> bytes:
    if kind == gguf.TokenType.BYTE:
        return bytes([int(token[3:5], 16)])
    return token.replace("\u2581", " ").encode()


def test_every_token_decodes_to_whole_characters() -> None:
    """A byte token above 0x7F would be part of a character: an answer could end inside it."""
    tokens, _, types = _vocab()
    for token, kind in zip(tokens, types, strict=True):
        if kind == gguf.TokenType.CONTROL or kind == gguf.TokenType.UNKNOWN:
            continue
        piece = _piece(token, kind)
        assert piece.decode("utf-8") and len(piece.decode()) == 1, token


def test_a_prompts_ascii_text_and_its_spaces_have_tokens() -> None:
    tokens, _, _ = _vocab()
    known = {_piece(t, gguf.TokenType.BYTE) for t in tokens if t.startswith("<0x")}
    assert all(bytes([b]) in known for b in b"What is a GPU?\n<|im_start|>")
    assert "\u2581" in tokens and "é" in tokens
