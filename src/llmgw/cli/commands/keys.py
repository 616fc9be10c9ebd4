"""`llmgw keys create|ls|rm`: the gateway's API keys, and with --viewer the read-only
viewer keys of the admin API and the fleet page; each shown once when made."""

from __future__ import annotations

import argparse
import time

from llmgw.cli.commands import _admin
from llmgw.cli.commands._table import ago, table
from llmgw.contract.keys import parse_expires
from llmgw.contract.records import PublicKey, PublicViewer
from llmgw.errors import Error


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("keys", help="the gateway's API keys: create, ls, rm NAME|PREFIX")
    ksub = p.add_subparsers(dest="keys_command", required=True)
    create = ksub.add_parser("create", help="make a key; it is printed this once")
    create.add_argument("--name", default="", help="what ls and /metrics call it "
                        "(default key-ID)")
    create.add_argument("--models", default="", metavar="A,B",
                        help="the models (names or aliases) it may use; default all")
    create.add_argument("--rpm", type=int, default=0, help="requests per minute (default no "
                        "limit)")
    create.add_argument("--tpm", type=int, default=0, help="tokens per minute, prompt and "
                        "completion (default no limit)")
    create.add_argument("--expires", default=None, metavar="DATE",
                        help="2027-01-31 (through that day, UTC), an ISO time, or 30d / 12h")
    ls = ksub.add_parser("ls", help="keys with their models, limits and usage; no secrets")
    rm = ksub.add_parser("rm", help="revoke a key; the gateway refuses it within a second")
    rm.add_argument("name", help="its name or prefix (sk-llmgw-XXXXXXXX), as ls shows")
    for q, run in ((create, _create), (ls, _ls), (rm, _rm)):
        _admin.add_host_options(q)
        q.add_argument("--viewer", action="store_true", help="a viewer key instead: it "
                       "reads the admin API and the fleet page (/ui/), and changes nothing")
        q.set_defaults(run=run)


def _create(args: argparse.Namespace) -> int:
    expires = _expires_given(args.expires)
    if args.viewer:
        return _create_viewer(args, expires)
    if args.rpm < 0 or args.tpm < 0:
        raise Error("--rpm and --tpm are counts per minute: 0 (no limit) or more")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    with _admin.admin(args) as client:
        made = _admin.call(client, lambda: client.create_key(
            name=args.name, models=models, rpm=args.rpm, tpm=args.tpm, expires=expires))
    print(made["key"])
    print(f"# key {made['name']} ({made['prefix']}): {_scope(made)}. It is shown only now; "
          "the host keeps its hash.")
    return 0


def _expires_given(text: str | None) -> float | None:
    try:
        return parse_expires(text, time.time()) if text else None
    except ValueError as e:
        raise Error(str(e)) from None


def _create_viewer(args: argparse.Namespace, expires: float | None) -> int:
    given = [f"--{o}" for o in ("models", "rpm", "tpm") if getattr(args, o)]
    if given:
        raise Error(f"{', '.join(given)} limit a gateway key; a viewer key reads the whole "
                    "fleet and changes nothing, so it takes --name and --expires alone")
    with _admin.admin(args) as client:
        made = _admin.call(client, lambda: client.create_viewer(name=args.name,
                                                                expires=expires))
    print(made["key"])
    print(f"# viewer key {made['name']} ({made['prefix']}): reads the admin API and the "
          f"fleet page (/ui/), changes nothing; expires {_expires(made, time.time())}. It is "
          "shown only now; the host keeps its hash.")
    return 0


def _ls(args: argparse.Namespace) -> int:
    if args.viewer:
        return _ls_viewers(args)
    with _admin.admin(args) as client:
        found = _admin.call(client, client.keys)
    now = time.time()
    rows = [[k["name"], k["prefix"], ",".join(k["models"]) or "all", _limits(k),
             _expires(k, now), ago(now - k["last_used"]) if k["last_used"] else "never",
             str(k["requests"]), f"{k['prompt_tokens']}/{k['completion_tokens']}"]
            for k in found]
    print(table(["NAME", "PREFIX", "MODELS", "LIMITS", "EXPIRES", "LAST USED", "REQUESTS",
                 "TOKENS IN/OUT"], rows, "no keys: `llmgw keys create` makes one"))
    return 0


def _ls_viewers(args: argparse.Namespace) -> int:
    with _admin.admin(args) as client:
        found: list[PublicViewer] = _admin.call(client, client.viewers)
    now = time.time()
    print(table(["NAME", "PREFIX", "MADE", "EXPIRES"],
                [[v["name"], v["prefix"], ago(now - v["created"]), _expires(v, now)]
                 for v in found],
                "no viewer keys: `llmgw keys create --viewer` makes one"))
    return 0


def _rm(args: argparse.Namespace) -> int:
    if args.viewer:
        with _admin.admin(args) as client:
            gone_viewer = _admin.call(client, lambda: client.revoke_viewer(args.name))
        print(f"revoked viewer key {gone_viewer['name']} ({gone_viewer['prefix']}); its "
              "fleet-page sessions end with it")
        return 0
    with _admin.admin(args) as client:
        gone = _admin.call(client, lambda: client.revoke_key(args.name))
    print(f"revoked {gone['name']} ({gone['prefix']}); the gateway refuses it from its next "
          "refresh (within a second)")
    return 0


def _scope(key: PublicKey) -> str:
    models = ", ".join(key["models"]) or "every model"
    return f"{models}; {_limits(key)}; {_expires(key, time.time())}"


def _limits(key: PublicKey) -> str:
    parts = [f"{key['rpm']} rpm" if key["rpm"] else "", f"{key['tpm']} tpm" if key["tpm"] else ""]
    return ", ".join(p for p in parts if p) or "no limits"


def _expires(key: PublicKey | PublicViewer, now: float) -> str:
    if key["expires"] is None:
        return "never"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(key["expires"]))
    return f"{when} (expired)" if key["expires"] <= now else when
