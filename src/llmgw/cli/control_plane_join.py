"""Another control plane of the same fleet, kubeadm's `join --control-plane` way.

`llmgw token create --control-plane` seals what every control plane of a fleet holds alike
(the cluster CA and its key, the admin token and its hash, the owner's gateway key, and
the server.yaml settings they share: the store above all) with a new certificate key,
AES-256-GCM, and leaves only the sealed bundle with the join token in the store. The key
is printed once, in the join line, and never stored or sent: the control plane that hands
the bundle out cannot open it, nor can anyone who reads the store. The new machine fetches
the bundle over the agent API after pinning the CA by its hash, opens it with the key,
checks that the fleet's store answers from there, and only then spends the token; from then
on it is provisioned as a first host is, on the fleet's store.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from llmgw import httpclient
from llmgw.agent.join import JoinError, pinned_ca, refusal
from llmgw.config import ServerConfig
from llmgw.contract import AgentPaths
from llmgw.errors import Error, shown_url
from llmgw.host.files import atomic_write
from llmgw.host.layout import Layout

_AAD = b"llmgw control-plane bundle 1"
KEY_HEX = 64
# The files every control plane of the fleet holds alike: name, Layout path, mode.
FILES = (
    ("ca.pem", "ca_cert", 0o644),
    ("ca-key.pem", "ca_key", 0o600),
    ("admin-token", "admin_token", 0o600),
    ("admin-token.sha256", "admin_token_hash", 0o644),
    ("gateway-key", "gateway_key", 0o600),
)
# The server.yaml settings the fleet shares; listeners, paths and certificates are each
# machine's own.
SHARED = ("store", "node_timeout_s", "tokens", "gateway_keys", "gateway_max_body_bytes",
          "gateway_routing", "gateway_queue_size", "gateway_queue_wait_s")
# What the new machine keeps of the bundle's settings until its server.yaml is written.
SETTINGS_FILE = "control-plane-join.json"


class ControlPlaneJoinError(Error):
    """A control-plane join that cannot go on; says what and what to do."""


@dataclass(frozen=True)
class Bundle:
    files: dict[str, bytes]
    server: dict[str, Any]


def new_certificate_key() -> str:
    return secrets.token_hex(KEY_HEX // 2)


def shareable(config: ServerConfig) -> None:
    """Refuse a fleet whose store only this machine can reach."""
    if not config.store:
        raise ControlPlaneJoinError(
            f"this control plane keeps its store in {config.store_at()}, which another "
            "machine cannot reach: move it to PostgreSQL first (`llmgw store migrate --to "
            "postgresql://USER@HOST:PORT/DB`, docs/operations.md), then make the token")


def seal(layout: Layout, config: ServerConfig, key_hex: str) -> str:
    """This control plane's shared secrets and settings, sealed with key_hex (base64)."""
    files = {name: base64.b64encode(getattr(layout, attr).read_bytes()).decode()
             for name, attr, _ in FILES if getattr(layout, attr).is_file()}
    body = json.dumps({"files": files, "server": {k: getattr(config, k) for k in SHARED}})
    nonce = os.urandom(12)
    sealed = AESGCM(certificate_key(key_hex)).encrypt(nonce, body.encode(), _AAD)
    return base64.b64encode(nonce + sealed).decode()


def unseal(text: str, key_hex: str) -> Bundle:
    """The bundle text sealed; ControlPlaneJoinError when key_hex does not open it."""
    try:
        raw = base64.b64decode(text, validate=True)
        body = json.loads(AESGCM(certificate_key(key_hex)).decrypt(raw[:12], raw[12:], _AAD))
    except InvalidTag:
        raise ControlPlaneJoinError(
            "the --certificate-key does not open the fleet's bundle: use the key printed "
            "in the same line as this token (`llmgw token create --control-plane` prints a "
            "new pair, and the token is spent now)") from None
    except ValueError as e:
        raise ControlPlaneJoinError(f"the control plane answered no bundle ({e})") from None
    files = {name: base64.b64decode(data) for name, data in body["files"].items()}
    return Bundle(files, dict(body["server"]))


def certificate_key(key_hex: str) -> bytes:
    """The key key_hex spells; ControlPlaneJoinError, saying what is wrong with it, for one
    that cannot be a certificate key. Checked before the token is spent on the bundle."""
    text = key_hex.strip().lower()
    if len(text) != KEY_HEX:
        found = f"has {len(text)} characters"
    elif any(c not in "0123456789abcdef" for c in text):
        found = "holds characters that are not hex digits"
    else:
        return bytes.fromhex(text)
    raise ControlPlaneJoinError(
        f"--certificate-key {found}, where {KEY_HEX} hex digits belong: copy the whole line "
        "`llmgw token create --control-plane` printed (the token is not spent yet)")


def fetch(url: str, token: str, ca_hash: str, who: str, *, spend: bool = True,
          timeout: float = httpclient.TIMEOUT_S) -> str:
    """The sealed bundle of the control-plane token, from the agent API at url, after the
    CA there is pinned by ca_hash; spends the token, unless spend=False (to check what
    the bundle names before the token is spent)."""
    url = url.rstrip("/")
    ca_pem = pinned_ca(url, ca_hash, timeout)
    body: dict[str, Any] = {"token": token, "name": who}
    if not spend:
        body["spend"] = False
    with httpclient.answered(JoinError, f"the control plane at {shown_url(url)}",
                              timeout=timeout):
        answer = httpclient.request("POST", f"{url}{AgentPaths.JOIN_CONTROL_PLANE}",
                                     verify=httpclient.tls(cadata=ca_pem), timeout=timeout,
                                     json=body)
    if answer.status_code != 200:
        raise JoinError(f"the control plane refused the control-plane join "
                        f"({answer.status_code}): {refusal(answer)}")
    return str(answer.json()["bundle"])


def write(bundle: Bundle, layout: Layout) -> list[str]:
    """The bundle's files in layout with their modes, and its settings kept for the
    server.yaml this machine writes next; the paths written."""
    written = []
    for name, attr, mode in FILES:
        if name in bundle.files:
            atomic_write(getattr(layout, attr), bundle.files[name], mode=mode)
            written.append(str(getattr(layout, attr)))
    settings = layout.etc / SETTINGS_FILE
    atomic_write(settings, json.dumps(bundle.server, indent=1), mode=0o600)
    return [*written, str(settings)]


def settings(layout: Layout) -> dict[str, Any]:
    """The fleet's shared server.yaml settings a control-plane join left (write())."""
    path = layout.etc / SETTINGS_FILE
    try:
        found: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ControlPlaneJoinError(
            f"the fleet's settings are not in {path} ({e}); they come with the fleet's CA "
            "when this machine first fetches it: make a new token with `llmgw token create "
            "--control-plane` on a control plane of the fleet and run again with its line"
        ) from None
    return {k: v for k, v in found.items() if k in SHARED}
