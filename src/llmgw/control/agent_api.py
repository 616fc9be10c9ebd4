"""The agent API over mutual TLS: a node is the CN of the client certificate it proved.

Served by the standard library's HTTP server rather than uvicorn, because uvicorn does
not hand the verified client certificate to the app (no ASGI TLS extension); identity
must come from the handshake, never from a request body.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from llmgw.control.engine_args import engine_args
from llmgw.control.store import Store

log = logging.getLogger("llmgw.agent_api")

HEARTBEAT_PATH = "/api/v1/agent/heartbeat"
_MAX_BODY = 4 * 1024 * 1024
_HANDSHAKE_TIMEOUT_S = 10.0

REPORTED_FIELDS = ("state", "err", "endpoint", "api_key")
REPORTED_STATES = ("downloading", "starting", "ready", "failed")


def mtls_context(ca: str, cert: str, key: str) -> ssl.SSLContext:
    """A server context that requires a client certificate signed by the cluster CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def peer_common_name(peercert: dict[str, Any] | None) -> str:
    for rdn in (peercert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


class AgentAPI:
    """What the agent API does, apart from how it is served."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def heartbeat(self, node_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """Record the node's inventory and replica states; answer with what it should run."""
        inventory = {k: v for k, v in body.items() if k not in ("node_id", "replicas")}
        # A body may say which node it is; the certificate decides.
        inventory["claimed_id"] = body.get("node_id", "")
        self.store.record_heartbeat(node_id, inventory)
        self._apply_reports(node_id, body.get("replicas") or [])
        return {"node_id": node_id, "replicas": self.assignments(node_id)}

    def _apply_reports(self, node_id: str, reports: list[dict[str, Any]]) -> None:
        mine = {r["id"]: r for r in self.store.replicas() if r["node"] == node_id}
        for report in reports:
            current = mine.get(str(report.get("id")))
            # A node reports only on its own replicas, and a stopped one stays stopped.
            if current is None or current["state"] == "stopped":
                continue
            if report.get("state") not in REPORTED_STATES:
                continue
            fields = {k: str(report.get(k) or "") for k in REPORTED_FIELDS}
            if any(current[k] != v for k, v in fields.items()):
                self.store.update_replica(current["id"], **fields)

    def assignments(self, node_id: str) -> list[dict[str, Any]]:
        """The replicas this node should run, with what it needs to start each."""
        models = {m["name"]: m for m in self.store.models()}
        result = []
        for r in self.store.replicas():
            model = models.get(r["model"])
            if r["node"] != node_id or r["state"] == "stopped" or model is None:
                continue
            profile = next((p for p in model["profiles"] if p["name"] == r["profile"]), None)
            if profile is None:
                continue
            result.append({
                "id": r["id"], "model": model["name"], "profile": profile["name"],
                "engine": profile["engine"], "gpu_class": profile["gpu_class"],
                "source": model["source"], "sha256": model["sha256"],
                "args": engine_args(model, profile),
            })
        return result


class _Handler(BaseHTTPRequestHandler):
    server: _MTLSServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.request.settimeout(_HANDSHAKE_TIMEOUT_S)
        try:
            self.request.do_handshake()
        except (ssl.SSLError, OSError) as e:
            log.info("refused a TLS client from %s: %s", self.client_address[0], e)
            self.handshake_ok = False
        else:
            self.handshake_ok = True
        super().setup()

    def handle(self) -> None:
        if self.handshake_ok:
            super().handle()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._reply(200, {"status": "ok", "node_id": self._node_id()})
        else:
            self._reply(404, {"detail": f"no such path {self.path}"})

    def do_POST(self) -> None:
        if self.path != HEARTBEAT_PATH:
            self._reply(404, {"detail": f"no such path {self.path}"})
            return
        node_id = self._node_id()
        if not node_id:
            self._reply(403, {"detail": "the client certificate has no CN to name a node by"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_BODY:
            self._reply(413, {"detail": f"a heartbeat is at most {_MAX_BODY} bytes"})
            return
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            self._reply(400, {"detail": f"the heartbeat is not valid JSON: {e}"})
            return
        self._reply(200, self.server.api.heartbeat(node_id, body))

    def _node_id(self) -> str:
        return peer_common_name(self.request.getpeercert())


class _MTLSServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], ctx: ssl.SSLContext, api: AgentAPI) -> None:
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.ctx = ctx
        self.api = api
        super().__init__(addr, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = self.socket.accept()
        # The handshake runs in the handler's thread, so a slow client holds up no one.
        return self.ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr


class AgentAPIServer:
    """The agent API on a background thread."""

    def __init__(self, host: str, port: int, ctx: ssl.SSLContext, api: AgentAPI) -> None:
        self._server = _MTLSServer((host, port), ctx, api)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="agent-api", daemon=True
        )

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
