"""Byte-level edits of replica answers: the model renamed, events split, usage read.

The gateway never decodes and re-encodes an answer: a JSON round trip would turn
non-ASCII text into \\u escapes and cost as much as the rest of the relay. It replaces
the bytes of the top-level "model" value and leaves every other byte as the engine sent it.
"""

from __future__ import annotations

import functools
import json
import re

# A JSON string inside another string has its quotes escaped (\"model\"), so this matches
# only a real "model" key; the engine writes it once, at the top level of each object.
_MODEL = re.compile(rb'"model"\s*:\s*"(?:[^"\\]|\\.)*"')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
# SSE events end with a blank line; any of the three line ends may be used (WHATWG HTML).
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


@functools.lru_cache(maxsize=1024)
def model_value(requested: str) -> bytes:
    """The bytes of the "model" member as the client should see it."""
    return b'"model":' + json.dumps(requested, ensure_ascii=False).encode()


def rename_model(data: bytes, member: bytes) -> bytes:
    """data with its first "model" member replaced by member (from model_value)."""
    return _MODEL.sub(lambda _: member, data, count=1)


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Whole SSE events (each with its blank-line end) and what is left of the buffer."""
    events, start = [], 0
    for m in _EVENT_END.finditer(buffer):
        events.append(buffer[start:m.end()])
        start = m.end()
    return events, buffer[start:]


def usage(data: bytes) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) when the bytes carry a usage object."""
    if b'"usage"' not in data:
        return None
    prompt, completion = _PROMPT.search(data), _COMPLETION.search(data)
    return (int(prompt[1]) if prompt else 0, int(completion[1]) if completion else 0)
