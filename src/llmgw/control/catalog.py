"""What the control plane reads of a catalog model's file: its size and KV geometry from
the GGUF header (the shape and rules of a catalog model are contract.catalog's)."""

from __future__ import annotations

import logging

import httpx

from llmgw import httpclient
from llmgw.contract.records import Geometry as GeometrySpec
from llmgw.errors import shown_url
from llmgw.model.ggufmeta import ChunkReader, GGUFError, read_geometry

log = logging.getLogger("llmgw.catalog")

# The header's geometry keys come before the tokenizer's; a header past this is not read.
HEADER_LIMIT = 64 << 20
HEADER_TIMEOUT_S = 10.0


def read_file_facts(source: str, *, timeout_s: float = HEADER_TIMEOUT_S,
                    transport: httpx.BaseTransport | None = None,
                    ) -> tuple[int, GeometrySpec, str]:
    """(size in bytes, KV geometry, '') of the GGUF file at an http(s) source, reading its
    header only (a range request); (0, {}, why) when it cannot be read. hf: sources are
    not fetched (the control plane may reach no hub): put the file in the mirror."""
    shown = shown_url(source)  # a catalog source may carry `user:password@`
    if not source.startswith(("http://", "https://")):
        return 0, {}, f"{shown} is not an http(s) URL (the mirror's are)"
    headers = {"Range": f"bytes=0-{HEADER_LIMIT - 1}"}
    try:
        with httpclient.client(timeout=timeout_s, transport=transport) as client, \
                client.stream("GET", source, headers=headers) as r:
            if r.status_code not in (200, 206):
                return 0, {}, f"GET {shown} answered {r.status_code}"
            size = _total_size(r)
            found = read_geometry(ChunkReader(r.iter_bytes(), shown, HEADER_LIMIT), shown)
    except (httpx.HTTPError, GGUFError) as e:
        return 0, {}, f"reading {shown}'s GGUF header: {e}"
    return size, found, ""


def _total_size(r: httpx.Response) -> int:
    """The whole file's size: after the '/' of Content-Range, else Content-Length."""
    if r.status_code == 206:
        total = r.headers.get("content-range", "").rpartition("/")[2]
        return int(total) if total.isdigit() else 0
    length = r.headers.get("content-length", "")
    return int(length) if length.isdigit() else 0
