"""`llmgw mirror serve`: the bytes server, the management API and the downloads, one process."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from llmgw.config import MIRROR_API_LISTEN, MIRROR_LISTEN, connect_host, parse_listen
from llmgw.http1.limits import Limits
from llmgw.http1.server import Http1Server
from llmgw.http1.service import listening, on_stop_signals
from llmgw.mirror import _metrics
from llmgw.mirror._api import make_api
from llmgw.mirror._bytes import BytesServer
from llmgw.mirror._downloads import Manager
from llmgw.mirror._errors import MirrorError

log = logging.getLogger("llmgw.mirror")

# The management API's limits: the core's, but a body may be a whole model file (an upload,
# `llmgw mirror import`; its route holds it to the size it declared).
API_LIMITS = Limits(max_body_bytes=1 << 40)
# A stopping mirror lets management requests under way finish this long, then cuts them.
API_DRAIN_S = 30.0


@dataclass(frozen=True)
class Options:
    dir: Path
    listen: str = MIRROR_LISTEN
    api_listen: str = MIRROR_API_LISTEN
    # Where nodes fetch from: http://ADDR:PORT[/path]; default: the listen address from here.
    base: str = ""
    # The admin token's sha256 file; without one the management API refuses all but /health.
    admin_token_hash: Path | None = None
    # The only folders file:// sources may be read from; none by default.
    import_dirs: tuple[Path, ...] = ()

    def base_url(self) -> str:
        return (self.base or f"http://{connect_host(self.listen)}").rstrip("/")


async def serve(options: Options) -> None:
    """Run until SIGTERM or SIGINT; downloads in flight stop and resume at the next start."""
    manager = Manager(options.dir, options.base_url(), import_dirs=options.import_dirs)
    manager.start()
    served = _metrics.ServedCounter()
    bytes_server = BytesServer(manager, urlsplit(options.base_url()).path, served)
    host, port = parse_listen(options.listen)
    try:
        await bytes_server.start(host, port)
    except OSError as e:
        manager.stop()
        raise MirrorError(f"cannot listen on {options.listen} for the bytes server: {e}") from e
    about = {"dir": str(options.dir), "base": options.base_url()}
    api = Http1Server(make_api(manager, token_hash=options.admin_token_hash, about=about,
                               metrics=_metrics.registry(manager, served)),
                      options.api_listen, drain_s=API_DRAIN_S, limits=API_LIMITS)
    on_stop_signals(log, lambda: setattr(api, "should_exit", True))
    try:
        serving = await listening(api, "the mirror's management API")
        log.info("mirror: %s; bytes on %s as %s; API on %s",
                 options.dir, options.listen, options.base_url(), options.api_listen)
        await serving
    finally:
        await bytes_server.close()
        await asyncio.to_thread(manager.stop)
        log.info("mirror stopped")
