"""The base error of llmgw.

Error
 ├── pki.PKIError
 ├── config.ConfigError
 ├── services.ServiceError
 ├── agent._build.BuildError
 ├── agent.engine.EngineUnavailable
 ├── agent.client.AgentAPIError
 ├── control.client.ControlPlaneError
 │    └── control.client.NotFound
 └── mirror.MirrorError
      ├── mirror.MirrorNotFound
      └── mirror.SourceError
"""

from __future__ import annotations


class Error(Exception):
    """Something llmgw found wrong; the message says what, why and what to do."""
