"""`llmgw logs REPLICA [-n N]`: the end of a replica's engine log, from its node.

The route: every heartbeat the agent sends the last 200 lines (at most 32 KB) of each
engine log it keeps, beside its replicas' states; the control plane keeps the latest with
the node, and GET /api/v1/replicas/ID/logs serves them. So the lines are at most one
heartbeat old, a stopped replica's log stays readable until the agent removes it, and no
connection is ever opened towards a node.
"""

from __future__ import annotations

import argparse

from llmgw.cli.commands import _admin


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("logs", help="the end of a replica's engine log")
    p.add_argument("replica", help="a replica id, as `llmgw status` lists it")
    p.add_argument("-n", type=int, default=50, help="how many lines (default 50, at most 200)")
    _admin.add_host_options(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with _admin.admin(args) as client:
        try:
            got = client.replica_logs(args.replica, args.n)
        except _admin.Error as e:
            if getattr(e, "status", 0) is None:
                raise _admin.unreachable(client, e) from None
            raise
    for line in got["lines"]:
        print(line)
    return 0
