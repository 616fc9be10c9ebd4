"""chatapp: one function that asks an OpenAI-compatible chat model for a one-line answer."""

from __future__ import annotations

from typing import Any

__all__ = ["one_line_answer"]


def one_line_answer(client: Any, model: str, question: str, max_tokens: int = 16,
                    **options: Any) -> str:
    """The model's answer to question, on one line (newlines folded), never empty.

    client is an openai.OpenAI; options go to its chat.completions.create as they are
    (extra_body=..., temperature=...); ValueError when the model answered no text."""
    reply = client.chat.completions.create(
        model=model, max_tokens=max_tokens,
        messages=[{"role": "user", "content": question}], **options,
    )
    text = " ".join((reply.choices[0].message.content or "").split())
    if not text:
        raise ValueError(f"{model} answered no text to {question!r}")
    return text
