"""The URL paths of the agent API (mTLS, nodes) and the admin API (loopback, admin token)."""

from __future__ import annotations

from collections.abc import Callable


class AgentPaths:
    """The agent API's paths; only the join paths serve a client without a
    certificate."""

    HEARTBEAT = "/api/v1/agent/heartbeat"
    SELF = "/api/v1/agent/self"
    RENEW = "/api/v1/agent/renew"
    # A joined node's last round of `llmgw check --serve`, under its certificate's name.
    DRIFT = "/api/v1/agent/drift"
    # Held until this node's assignments differ from ?since=REVISION (a heartbeat answer's
    # revision), or answered unchanged after a hold: the node then beats at once.
    WATCH = "/api/v1/agent/watch"
    JOIN = "/api/v1/join"
    JOIN_CA = "/api/v1/join/ca"
    # Another control plane's join: its token's sealed bundle (`token create --control-plane`).
    JOIN_CONTROL_PLANE = "/api/v1/join/control-plane"
    # Public, as any CA's revocation list is: a node refused at the handshake reads it to
    # learn why (asyncio drops the TLS alert that would have said so).
    CRL = "/api/v1/join/crl"
    HEALTH = "/healthz"


def _item(collection: str) -> Callable[[str], str]:
    """The path of one item of collection, by its name or id."""
    return lambda name: f"{collection}/{name}"


class AdminPaths:
    """The admin API's paths; every one but HEALTH needs the admin token (a viewer key,
    or a fleet-page session, may GET)."""

    HEALTH = "/healthz"
    METRICS = "/metrics"
    NODES = "/api/v1/nodes"
    TOKENS = "/api/v1/tokens"
    MODELS = "/api/v1/models"
    REPLICAS = "/api/v1/replicas"
    KEYS = "/api/v1/keys"
    DRIFT = "/api/v1/drift"
    CONTROL_PLANES = "/api/v1/control-planes"
    # Read-only credentials (`llmgw keys create --viewer`), and the gateway's traffic per
    # model; the fleet page (/ui/) reads these with the others.
    VIEWERS = "/api/v1/viewers"
    TRAFFIC = "/api/v1/traffic"

    # One item's path: its collection's, then /NAME.
    node = staticmethod(_item(NODES))
    model = staticmethod(_item(MODELS))
    drift = staticmethod(_item(DRIFT))
    key = staticmethod(_item(KEYS))
    viewer = staticmethod(_item(VIEWERS))

    @staticmethod
    def replica_logs(replica_id: str) -> str:
        return f"{AdminPaths.REPLICAS}/{replica_id}/logs"
