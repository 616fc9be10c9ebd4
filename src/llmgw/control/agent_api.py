"""The agent API over TLS: a node is the CN of the client certificate it proved.

Every path needs a client certificate from the cluster CA except the two of joining
(the CA itself, and signing a new node's CSR against a join token): the handshake asks
for a certificate but lets a client without one through, and every other path refuses it.
A removed node's serial is on the revocation list the handshake checks.
"""

from __future__ import annotations

import datetime as dt
import logging
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from pydantic import ValidationError

from llmgw.contract import AgentPaths, ReplicaState, secret
from llmgw.contract.records import (
    DRIFT_REPORT,
    REPORTS,
    Assignment,
    HeartbeatAnswer,
    NodeReplica,
    RecordError,
    ReplicaUpdate,
    checked,
)
from llmgw.control._tlsserver import Peer, Reply, Request, TLSServer
from llmgw.control._watch import Watches, revision
from llmgw.control.drift import DriftBoard
from llmgw.control.nodes import node_view
from llmgw.control.scheduler import needed_engine
from llmgw.host import pki
from llmgw.http1.limits import Limits
from llmgw.model.engine_args import engine_args, rpc_server_args
from llmgw.store import Store, StoreError
from llmgw.store.nodes import REWRITE_EVERY_S

log = logging.getLogger("llmgw.agent_api")

_ANONYMOUS_PATHS = {("GET", AgentPaths.JOIN_CA), ("POST", AgentPaths.JOIN),
                    ("POST", AgentPaths.JOIN_CONTROL_PLANE), ("GET", AgentPaths.CRL)}



def token_hash(token: str) -> str:
    """How a join token is stored: never the token itself."""
    return secret.digest(token)


def mtls_context(ca: str, cert: str, key: str, crl: str | None = None) -> ssl.SSLContext:
    """A server context that checks a client certificate against the cluster CA (and the
    revocation list crl, a PEM file, when given). A client may show none: only the join
    paths serve it."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    # No TLS 1.3 session tickets: no agent resumes a session (httpx does not), and making
    # two per handshake was about a quarter of the server's CPU per handshake
    # (bench/handshakes.py, OpenSSL 3.0): a restart under 5,000 nodes is 5,000 of them.
    ctx.num_tickets = 0
    if crl:
        ctx.load_verify_locations(crl)
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return ctx


class AgentAPI:
    """What the agent API does, apart from how it is served.

    ca is the cluster authority with its key, for signing joins and renewals; without it
    the control plane cannot admit nodes and says so.

    control_planes: the agent API URLs of every live control plane of the fleet, asked at
    each heartbeat and put in its answer; None stands for this one alone, at agent_url
    (fleet.agent_url of its server.yaml). With neither, answers carry no list, and agents
    keep the one they have.

    control_plane: this control plane's id, recorded in each node it hears as the one that
    node beats to ("" records none).
    """

    def __init__(self, store: Store, ca: pki.KeyPair | None = None, *,
                 node_timeout_s: float = 30.0, mirror_url: str = "",
                 control_planes: Callable[[], list[str]] | None = None,
                 agent_url: str = "", control_plane: str = "") -> None:
        self.store = store
        self.ca = ca
        self.node_timeout_s = node_timeout_s
        self.mirror_url = mirror_url
        self.control_planes = control_planes or (lambda: [agent_url] if agent_url else [])
        self.control_plane = control_plane
        self.revoked = set(store.revoked_serials())
        # Hosts' drift; the admin API shows the same board (server.py hands it over).
        self.drift = DriftBoard()
        # Around each heartbeat's handling: server.py times it for the metrics.
        self.heartbeat_timer: Callable[[], AbstractContextManager[object]] = nullcontext
        # Nodes' held watches, on the server's loop (the only async route).
        self.watches = Watches(store.live_replicas,
                               lambda rows: revision(_assignments(rows)))

    # --- routing ---

    def gate(self, method: str, path: str, peer: Peer) -> Reply | None:
        """The answer a request gets from its head alone: 401 for a path that needs a client
        certificate the client did not show (its body is never waited for)."""
        if not peer.cn and (method, path) not in _ANONYMOUS_PATHS:
            return Reply(401, {"detail": f"{path} needs a client certificate from the "
                                         f"cluster CA; only {AgentPaths.JOIN} takes none"},
                         close=True)
        return None

    def handle(self, request: Request) -> Reply | Awaitable[Reply]:
        route = (request.method, request.path)
        refused = self.gate(request.method, request.path, request.peer)
        if refused is not None:
            return refused
        routes = {
            ("GET", AgentPaths.HEALTH):
                lambda r: Reply(200, {"status": "ok", "node_id": r.peer.cn}),
            ("POST", AgentPaths.HEARTBEAT): self._heartbeat,
            ("GET", AgentPaths.WATCH): self._watch,
            ("GET", AgentPaths.SELF): self._self,
            ("POST", AgentPaths.RENEW): self._renew,
            ("PUT", AgentPaths.DRIFT): self._drift,
            ("GET", AgentPaths.JOIN_CA): self._ca,
            ("GET", AgentPaths.CRL): self._crl,
            ("POST", AgentPaths.JOIN): self._join,
            ("POST", AgentPaths.JOIN_CONTROL_PLANE): self._join_control_plane,
        }
        action: Callable[[Request], Reply | Awaitable[Reply]] | None = routes.get(route)
        if action is None:
            return Reply(404, {"detail": f"no such path {request.method} {request.path}"})
        try:
            return action(request)
        except ValueError as e:
            return Reply(400, {"detail": f"the body is not valid JSON: {e}"})

    def refused(self, peer: Peer) -> str | None:
        """Why a client that passed the handshake is turned away (a revoked serial that a
        context without a revocation list let through)."""
        return "its certificate was revoked" if peer.serial in self.revoked else None

    # --- a node's own paths ---

    def _heartbeat(self, request: Request) -> Reply:
        body = request.json()
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        try:
            with self.heartbeat_timer():
                answer = self.heartbeat(request.peer.cn, body, request.peer.serial)
            return Reply(200, answer)
        except RecordError as e:
            # An agent's body is untrusted: refused whole, naming each bad key; nothing stored.
            return Reply(422, {"detail": f"{e}; fix the agent (or upgrade it to match "
                                         "this control plane)"})
        except StoreError as e:
            # Cut off from the store: a 503 the agent takes as a reason to try another
            # control plane. Silence is counted from the store's return (Hearing), so no
            # node is lost for the outage.
            return Reply(503, {"detail": f"{self.store.why(e)}; this heartbeat was not "
                                         "recorded and no node is counted lost for it: send "
                                         "it to another control plane, or here again"},
                         retry_after=5)

    def heartbeat(self, node_id: str, body: Mapping[str, object],
                  serial: str = "") -> HeartbeatAnswer:
        """Record the node's inventory and replica states; answer with what it should run.
        body is the agent's Heartbeat, untrusted: the store checks what it keeps."""
        inventory = {k: v for k, v in body.items() if k not in ("node_id", "replicas")}
        # A body may say which node it is; the certificate decides.
        inventory["claimed_id"] = body.get("node_id", "")
        # Which control plane the node beats to is this one's to say, not the body's.
        inventory["control_plane"] = self.control_plane
        reports = _reports(node_id, body.get("replicas"))
        # A third of the node timeout: every control plane sees a node's last_seen well
        # within it (store.nodes.REWRITE_EVERY_S).
        rows = self.store.heartbeat(node_id, inventory, serial, reports,
                                    rewrite_every_s=min(REWRITE_EVERY_S,
                                                        self.node_timeout_s / 3))
        assigned = _assignments(rows)
        answer: HeartbeatAnswer = {"node_id": node_id, "replicas": assigned,
                                   "revision": revision(assigned)}
        if self.mirror_url:
            answer["mirror"] = self.mirror_url
        planes = self.control_planes()
        if planes:
            answer["control_planes"] = list(planes)
        return answer

    def _watch(self, request: Request) -> Reply | Awaitable[Reply]:
        """Held until this node's assignments differ from ?since= (its last heartbeat
        answer's revision): then {"changed": true}, and the node beats at once; else
        {"changed": false} after the hold (control._watch)."""
        since = request.query.get("since", "")
        if not since:
            return Reply(422, {"detail": f"{AgentPaths.WATCH} needs ?since=REVISION, the "
                                         "revision of this node's last heartbeat answer"})

        async def held() -> Reply:
            return Reply(200, await self.watches.watch(request.peer.cn, since))
        return held()

    def _self(self, request: Request) -> Reply:
        node = self.store.node(request.peer.cn)
        if node is None:
            return Reply(404, {"detail": f"{request.peer.cn} has not sent a heartbeat yet"})
        return Reply(200, node_view(node, self.store.clock(), self.node_timeout_s,
                                   self.store.hearing))

    def _drift(self, request: Request) -> Reply:
        """This node's last round of `llmgw check --serve`, kept under its certificate's
        name (whatever the body says), beside the rounds the admin API takes."""
        try:
            report = DRIFT_REPORT.validate_python(request.json())
            return Reply(200, self.drift.put(request.peer.cn, report))
        except ValidationError as e:
            return Reply(422, {"detail": f"the drift report is not one: {e}"})

    def _renew(self, request: Request) -> Reply:
        """A new certificate for the same node, for a key the node made."""
        csr = str(request.json().get("csr", "")).encode()
        return self._sign(csr, request.peer.cn)

    # --- joining ---

    def _ca(self, request: Request) -> Reply:
        if self.ca is None:
            return Reply(503, {"detail": _NO_CA_KEY})
        return Reply(200, {"ca": _pem(self.ca)})

    def _crl(self, request: Request) -> Reply:
        if self.ca is None:
            return Reply(503, {"detail": _NO_CA_KEY})
        return Reply(200, {"crl": pki.make_crl(self.ca, sorted(self.revoked)).decode()})

    def _join(self, request: Request) -> Reply:
        body = request.json()
        node_id, token = str(body.get("node_id", "")), str(body.get("token", ""))
        if not node_id or not token or not body.get("csr"):
            return Reply(422, {"detail": "a join needs node_id, token and csr"})
        if self.store.node_known(node_id):
            return Reply(409, {"detail": f"a node named {node_id} already exists; join under "
                                         f"another name (--node-name NAME), or remove it first "
                                         f"with `llmgw node rm {node_id}` on the control plane"})
        spent = self.store.use_token(token_hash(token), node_id)
        if spent != "ok":
            return Reply(403, {"detail": f"the join token is {spent}; tokens are single use "
                                         "and expire: run `llmgw token create` on the control "
                                         "plane for a new one"})
        log.info("node %s joined from %s", node_id, request.peer.addr)
        return self._sign(str(body["csr"]).encode(), node_id)

    def _join_control_plane(self, request: Request) -> Reply:
        """A control-plane token's sealed bundle, once: this process cannot open it (the
        certificate key is only in the join line), so it hands out nothing it could read.
        With "spend": false, the bundle of a token still good, left unspent: the new
        machine checks that it reaches the fleet's store before it spends the token."""
        body = request.json()
        token, who = str(body.get("token", "")), str(body.get("name", "")) or request.peer.addr
        if not token:
            return Reply(422, {"detail": "a control-plane join needs its token"})
        spend = body.get("spend", True) is not False
        spent, bundle = self.store.use_control_plane_token(token_hash(token), who, spend)
        if spent != "ok":
            return Reply(403, {"detail": f"the join token is {spent}; run `llmgw token create "
                                         "--control-plane` on a control plane of the fleet "
                                         "for a new one"})
        if spend:
            log.info("control plane %s joined from %s", who, request.peer.addr)
        else:
            log.info("control plane %s read its bundle from %s (the token is not spent yet)",
                     who, request.peer.addr)
        return Reply(200, {"bundle": bundle})

    def _sign(self, csr: bytes, node_id: str) -> Reply:
        if self.ca is None:
            return Reply(503, {"detail": _NO_CA_KEY})
        try:
            cert = pki.sign_csr(self.ca, csr, node_id)
        except pki.PKIError as e:
            return Reply(422, {"detail": str(e)})
        self.store.add_cert(pki.serial_hex(cert), node_id, cert.not_valid_after_utc.timestamp())
        pem = cert.public_bytes(serialization.Encoding.PEM).decode()
        return Reply(200, {"node_id": node_id, "cert": pem, "ca": _pem(self.ca),
                           "mirror": self.mirror_url})


_NO_CA_KEY = ("this control plane has no CA key to sign with; nodes can join only where "
              "ca-key.pem is (ca_key in server.yaml)")


def _pem(pair: pki.KeyPair) -> str:
    return pair.cert.public_bytes(serialization.Encoding.PEM).decode()


def _reports(node_id: str, raw: Any) -> dict[str, ReplicaUpdate]:
    """A node's reports on its replicas (id → the fields it may change), checked once here
    (contract.records.ReplicaReport): a state it may not report, a missing field or a wrong
    type is a RecordError naming it, and the heartbeat is refused whole."""
    reports = checked(REPORTS, {"replicas": raw or []},
                      f"node {node_id}'s replica reports")["replicas"]
    found: dict[str, ReplicaUpdate] = {}
    for r in reports:
        found[r["id"]] = {"state": ReplicaState(r["state"]), "err": r.get("err", ""),
                          "endpoint": r.get("endpoint", ""), "api_key": r.get("api_key", "")}
        if "relay_port" in r:  # a worker's share of a split replica: its relay
            found[r["id"]]["relay_port"] = r["relay_port"]
    return found


def _assignments(rows: list[NodeReplica]) -> list[Assignment]:
    """What the node runs: its replicas, and its shares of split replicas it is a worker
    of. A split replica's main node gets it only once every worker reported its relay's
    port (and its heartbeat gave its management address): before that its engine would
    have nowhere to send its layers."""
    result: list[Assignment] = []
    for r in rows:
        model = r["spec"]
        if model is None:
            continue
        profile = next((p for p in model["profiles"] if p["name"] == r["profile"]), None)
        if profile is None:
            continue
        share, workers = r.get("share"), r.get("workers") or []
        if share is None and not all(w["port"] > 0 and w["addr"] for w in workers):
            continue
        assignment: Assignment = {
            "id": r["id"], "model": model["name"], "profile": profile["name"],
            "engine": needed_engine(profile), "gpu_class": profile["gpu_class"],
            "source": model["source"], "sha256": model["sha256"],
            "args": engine_args(model, profile),
            # The GPUs the scheduler counted this replica on: the agent holds it to them.
            "gpus": list(r.get("gpus") or []),
        }
        if share is not None:
            # rpc-server takes the profile's threads alone (engine_args.RPC_SERVER_FLAGS),
            # and the worker's own cards where the profile is a GPU one (none: its CPU).
            assignment["args"] = rpc_server_args(profile["args"])
            assignment["gpus"] = list(share.get("gpus") or []) if profile["gpu_class"] else []
            assignment["split"] = {"role": "worker", "main": r["node"],
                                   "layers": share["layers"]}
        elif workers:
            assignment["split"] = {"role": "main", "workers": [{**w} for w in workers]}
            if profile["gpu_class"]:
                # The layers its own cards share (the rest are the workers').
                held = sum(w["layers"] for w in workers)
                assignment["split"]["layers"] = max(
                    model["geometry"].get("block_count", 0) - held, 0)
        result.append(assignment)
    return result


class AgentAPIServer:
    """The agent API on its own thread and event loop; revocations apply at once.

    With tls (ca, cert, key) and the CA key, the handshake checks a revocation list; a
    removal adds a newer one to the same context, which the next handshake uses (OpenSSL
    picks the newest list of an issuer), and closes the node's open connections.
    """

    def __init__(self, host: str, port: int, ctx: ssl.SSLContext, api: AgentAPI,
                 *, tls: tuple[str, str, str] | None = None,
                 limits: Limits | None = None) -> None:
        self.api = api
        self._crl_dir = tempfile.TemporaryDirectory(prefix="llmgw-crl-")
        self._crl_at = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
        if tls and api.ca is not None:
            ctx = mtls_context(*tls, crl=self._write_crl())
        self.ctx = ctx
        self._server = TLSServer(host, port, ctx, api.handle, refused=api.refused,
                                 gate=api.gate, limits=limits)

    @property
    def port(self) -> int:
        return self._server.port

    def connections(self) -> int:
        """Connections open now."""
        return self._server.connections()

    def accepted(self) -> int:
        """Connections served since start."""
        return self._server.accepted

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        # Held watches answered first: a stopping server would hold them for its drain.
        self._server.call(self.api.watches.close)
        self._server.stop()
        self._crl_dir.cleanup()

    def revoke(self, serials: list[str]) -> None:
        """Refuse these serials from the next handshake on, and close their connections."""
        self.api.revoked.update(serials)
        if self.ctx.verify_flags & ssl.VERIFY_CRL_CHECK_LEAF:
            crl = self._write_crl()
            self._server.call(lambda: self.ctx.load_verify_locations(crl))
        self._server.drop(set(serials))

    def _write_crl(self) -> str:
        assert self.api.ca is not None
        # Each list strictly newer than the last (whole seconds), so OpenSSL takes it.
        self._crl_at = max(self._crl_at + dt.timedelta(seconds=1),
                           dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5))
        path = Path(self._crl_dir.name) / f"crl-{self._crl_at.timestamp():.0f}.pem"
        path.write_bytes(pki.make_crl(self.api.ca, sorted(self.api.revoked),
                                      last_update=self._crl_at))
        return str(path)
