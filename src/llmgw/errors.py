"""The base error of llmgw: every exception class llmgw and its harness (llmgw_harness)
define is below it, as this tree names it (tests/test_errors.py holds the two to each
other). And shown_url, how a message, a log line or an answer shows a URL: without the
credentials it may carry.

Error
 ├── host.pki.PKIError
 ├── config.ConfigError
 ├── model.engine_args.EngineArgsError (also a ValueError: a flag a profile may not give)
 ├── contract.records.RecordError (also a ValueError: a record the store refuses)
 ├── host.admin_token.AdminTokenError
 ├── host.services.ServiceError
 ├── host.commands.CommandFailed (pip, cmake or systemctl failed: its last lines, its log)
 ├── http1.service.ListenError (a service cannot listen on its address)
 ├── host.install.InstallError
 ├── host.accounts.AccountError
 ├── agent.engines._build.BuildError
 ├── agent.engines._toolchain.ToolchainError (no CUDA toolchain: CudaBuild makes it a BuildError)
 ├── agent.engines.cpu.EngineUnavailable
 ├── agent.sizing.DoesNotFit (a GPU replica's cards have no room for one slot now)
 ├── agent.join.JoinError
 ├── agent.rpc_relay.RelayError (a split replica's relay or rpc-server could not start)
 ├── agent.revocation.RevocationError (a revocation list not of this cluster's CA)
 ├── cli.control_plane_join.ControlPlaneJoinError (a bundle that does not open, a fleet on SQLite)
 ├── store.StoreError (a read or a write the store could not do: away, busy, broken)
 │    └── store.StoreConflict (a unique key refused a write: the name is taken)
 ├── store.LeaseLost (a fenced write found the scheduler lease another's)
 ├── store._db.SchemaError (the store's schema is not the one this code reads)
 ├── store.copy.CopyError (a copy of a store that does not read back the same)
 ├── cli.backup.BackupError
 ├── model.ggufmeta.GGUFError
 ├── gateway.balancer.Saturated (every replica's queue is full)
 ├── gateway._demand.LoadFailed (no replica of a waited-for model came: why)
 ├── gateway.app.GatewayError (an answer in OpenAI's error shape)
 ├── gateway._upstream.UpstreamError (a replica failed once the request was sent)
 │    └── gateway._upstream.ConnectFailed (it never reached the engine: try another)
 ├── gateway._replica_conn.TooLarge (a replica's answer over the cap gathered whole)
 ├── mirror._sources.Changed (the source is no longer the file a partial came from)
 ├── mirror._sources.Gone (the source refused in a way a retry will not fix)
 ├── mirror._sources.Unavailable (the source is busy or failing for now)
 ├── mirror._transfer.Stopped (the mirror is shutting down)
 ├── mirror._transfer.Interrupted (the connection ended before the whole file came)
 ├── host.waiting.WaitTimeout (also an AssertionError)
 ├── llmgw_harness._registry.RegistryError (the harness's steps contradict each other)
 ├── llmgw_harness._throwaway.HostError (also an AssertionError: a throwaway host did not come up)
 ├── llmgw_harness._promise.CannotFix (also an AssertionError: a fix cannot do its job)
 └── APIError (an llmgw API did not answer, or refused)
      ├── Unreachable (no answer, or a 503: another control plane, or a later try, may answer)
      ├── agent.client.AgentAPIError (the agent API refused this node, or answered wrongly)
      │    └── agent.client.NodeRemoved (the control plane revoked this node's certificate)
      ├── control.client.ControlPlaneError
      │    └── control.client.NotFound
      └── mirror.MirrorError
           ├── mirror.MirrorNotFound
           ├── mirror._errors.SourceError
           ├── mirror._errors.Forbidden
           └── mirror._downloads.Conflict
                └── mirror._downloads.WrongOffset (an import resumed at another byte)

Outside it, on purpose:
- a private class (a leading _) is a signal within its module that never leaves it;
- agent.engines.prebuilt_server.UsageError: that script runs in the prebuilt engine's own venv,
  which has no llmgw to import.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


class Error(Exception):
    """Something llmgw found wrong; the message says what, why and what to do."""


class APIError(Error):
    """An llmgw API could not be reached or refused a request.

    status is the HTTP status of the answer, None when there was no answer.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def transient(self) -> bool:
        """Whether asking again may get another answer: none came (a restart), or a 5xx."""
        return self.status is None or self.status >= 500


class Unreachable(APIError):
    """No llmgw API answered: none is configured here, nothing answers at its address in
    time, or it said it cannot serve now (503). Another control plane of the fleet, or a
    later try, may answer; the CLI exits 3 on it."""


def shown_url(url: str) -> str:
    """url as a person may see it: its scheme, host, port and path, never the user or
    password before an `@` (HTTPS_PROXY's `user:password@`, a store's, HF_ENDPOINT's), nor
    its query or fragment (a signed URL's token, libpq's `?password=`), which show as `?…`.
    What is not a URL (a path, `hf:ORG/REPO/FILE`) comes back as it is.

    The path stays: it names the file a source is, or the database a store is; llmgw never
    takes a secret from it."""
    if "://" not in url:
        return url
    try:
        parts = urlsplit(url)
        # A port that is no number: an unescaped / ? or # in a password cut the host short,
        # and what stands there is part of the password.
        parts.port  # noqa: B018
    except ValueError:
        return f"{url.split('://', 1)[0]}://(a URL that does not parse)"
    host = parts.netloc.rpartition("@")[2]
    cut = "?…" if parts.query or parts.fragment else ""
    return urlunsplit((parts.scheme, host, parts.path, "", "")) + cut
