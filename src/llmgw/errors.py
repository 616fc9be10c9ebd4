"""The base error of llmgw.

Error
 ├── pki.PKIError
 ├── config.ConfigError
 ├── admin_token.AdminTokenError
 ├── services.ServiceError
 ├── install.InstallError
 ├── accounts.AccountError
 ├── agent._build.BuildError
 ├── agent._cuda.ToolchainError (no CUDA toolchain can be had; CudaBuild makes it a BuildError)
 ├── agent.engine.EngineUnavailable
 ├── agent.client.AgentAPIError
 │    ├── agent.client.NodeRemoved (the control plane revoked this node's certificate)
 │    └── agent.client.Unreachable (no answer in time: another control plane may give one)
 ├── agent.join.JoinError
 ├── waiting.WaitTimeout (also an AssertionError)
 └── APIError (an llmgw API did not answer, or refused)
      ├── control.client.ControlPlaneError
      │    └── control.client.NotFound
      └── mirror.MirrorError
           ├── mirror.MirrorNotFound
           ├── mirror.SourceError
           └── mirror.Forbidden
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
