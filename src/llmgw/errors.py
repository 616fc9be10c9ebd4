"""The base error of llmgw.

Error
 ├── pki.PKIError
 ├── config.ConfigError
 ├── admin_token.AdminTokenError
 ├── services.ServiceError
 ├── _service.ListenError (a service cannot listen on its address)
 ├── install.InstallError
 ├── accounts.AccountError
 ├── agent._build.BuildError
 ├── agent._cuda.ToolchainError (no CUDA toolchain can be had; CudaBuild makes it a BuildError)
 ├── agent.engine.EngineUnavailable
 ├── agent.client.AgentAPIError
 │    ├── agent.client.NodeRemoved (the control plane revoked this node's certificate)
 │    └── agent.client.Unreachable (no answer in time: another control plane may give one)
 ├── agent.join.JoinError
 ├── control_plane_join.ControlPlaneJoinError (a bundle that does not open, a fleet on SQLite)
 ├── control.store.LeaseLost (a fenced write found the scheduler lease another's)
 ├── control.store._db.SchemaError (the store's schema is not the one this code reads)
 ├── control.store.copy.CopyError (a copy of a store that does not read back the same)
 ├── backup.BackupError
 ├── ggufmeta.GGUFError
 ├── control.balancer.Saturated (every replica's queue is full)
 ├── control._upstream.UpstreamError (a replica failed once the request was sent)
 │    └── control._upstream.ConnectFailed (it never reached the engine: try another)
 ├── commands._admin.Unreachable (no control plane answers the CLI)
 ├── waiting.WaitTimeout (also an AssertionError)
 └── APIError (an llmgw API did not answer, or refused)
      ├── control.client.ControlPlaneError
      │    └── control.client.NotFound
      └── mirror.MirrorError
           ├── mirror.MirrorNotFound
           ├── mirror.SourceError
           ├── mirror.Forbidden
           └── mirror._downloads.Conflict
"""

from __future__ import annotations


class Error(Exception):
    """Something llmgw found wrong; the message says what, why and what to do."""


class APIError(Error):
    """An llmgw API could not be reached or refused a request.

    status is the HTTP status of the answer, None when there was no answer.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
