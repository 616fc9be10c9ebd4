"""A replica's weights: the model file downloaded once over http(s) into the weights cache,
its sha256 checked against the catalog's before it is used."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx

from llmgw.errors import shown_url


def fetch(http: httpx.Client, weights_dir: Path, source: str, sha256: str, model: str) -> Path:
    """The model file at source, in weights_dir/<sha256 or model>/<its name>."""
    url, shown = urlparse(source), shown_url(source)  # a source may carry a password
    # Never file://: the agent runs as root and would hand any file to an engine.
    if url.scheme not in ("http", "https"):
        raise ValueError(f"the agent downloads weights only over http(s), from the "
                         f"mirror or a URL, not {shown}; put the file in the "
                         "mirror with `llmgw mirror import`")
    name = Path(unquote(url.path)).name or "model.gguf"
    target = weights_dir / (sha256 or model) / name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{name}.part")
    digest = hashlib.sha256()
    with http.stream("GET", source) as response:
        if not response.is_success:  # not raise_for_status(): its words carry the URL whole
            raise ValueError(f"GET {shown} answered {response.status_code} "
                             f"{response.reason_phrase}")
        with open(tmp, "wb") as f:
            for chunk in response.iter_bytes(1 << 20):
                digest.update(chunk)
                f.write(chunk)
    if sha256 and digest.hexdigest() != sha256:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"{shown} has sha256 {digest.hexdigest()}, the catalog "
                         f"says {sha256}; the mirror's copy is wrong or was replaced")
    os.replace(tmp, target)
    return target
