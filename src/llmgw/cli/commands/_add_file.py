"""`llmgw models add SOURCE`: a GGUF file fetched, checked, put in the mirror and added to
the catalog with the starter's profiles, saying where it will run. Every refusal comes
before the mirror or the catalog changes."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from llmgw.cli.clients import mirror_client
from llmgw.cli.commands import _admin
from llmgw.cli.model_source import (
    ModelFile,
    download,
    progress_lines,
    read_header,
    read_local,
    resolve,
)
from llmgw.contract.catalog import CATALOG_MODEL, ModelSpec, default_profiles, names
from llmgw.contract.explain import problems
from llmgw.contract.records import NodeView, PublicReplica, ReplicaRecord
from llmgw.errors import Error, Unreachable, shown_url
from llmgw.host.layout import Layout
from llmgw.host.services import read_environment_file
from llmgw.mirror import MirrorClient
from llmgw.mirror._disk import is_name
from llmgw.mirror._sources import HUB_ENV, Source
from llmgw.model.ggufmeta import catalog_name

# The options that shape a model added from a file (a YAML spec says them itself).
FILE_OPTIONS = ("name", "alias", "min", "max", "idle")
# Where a catalog model's source is checked before the mirror has its URL.
_PLACEHOLDER = "http://mirror.invalid/model.gguf"


def add_file_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default=None,
                   help="its catalog name (default: the file's general.name, else its file "
                        "name, as a catalog name)")
    p.add_argument("--alias", action="append", default=None, metavar="ALIAS",
                   help="another name clients may ask for; repeatable")
    p.add_argument("--min", type=int, default=None, metavar="N",
                   help="replicas kept at least (scaling.min, default 1)")
    p.add_argument("--max", type=int, default=None, metavar="N",
                   help="replicas at most (scaling.max, default --min or 1)")
    p.add_argument("--idle", type=int, default=None, metavar="SECONDS",
                   help="scaling.idle_s: how long a replica above --min may go without a "
                        "request before it is removed (sent only when given)")


def add_file(args: argparse.Namespace) -> int:
    _hub_settings(Layout.for_mode(args.mode, args.state_dir))
    found = resolve(args.file)  # a wrong source is refused here, before any network
    if isinstance(found, Path):
        read_header(found)  # and a local file that is not GGUF
    with _admin.admin(args) as admin:
        nodes = _admin.call(admin, admin.nodes)
        catalog = _admin.call(admin, admin.models)
        replicas = _admin.call(admin, admin.replicas)
    with _mirror(args) as mirror, tempfile.TemporaryDirectory(prefix="llmgw-add-") as tmp:
        file = _local(found, Path(tmp))
        spec = _spec(args, file, sorted({str(g["class"]) for n in nodes for g in n["gpus"]
                                         if g.get("class")}))
        _check(spec, catalog)
        version = file.sha256[:12]
        held = mirror.upload(_named(file.path, Path(tmp)), model=spec["name"], version=version,
                             sha256=file.sha256, progress=progress_lines(
                                 f"into the mirror as {spec['name']}/{version}")(file.size))
    spec["source"] = held["url"]
    with _admin.admin(args) as admin:
        try:
            added = _admin.call(admin, lambda: admin.add_model(spec))
        except Error as e:
            kind = Unreachable if isinstance(e, Unreachable) else Error
            raise kind(f"{e} (the file stays in the mirror as {spec['name']}/{version}: the "
                       "same command again adds it, and does not upload it again)") from None
    for line in _said(added, file, f"{spec['name']}/{version}", nodes, replicas, catalog):
        print(line)
    return 0


def _hub_settings(layout: Layout) -> None:
    """The hub's variables (HF_ENDPOINT, HF_TOKEN, proxies) the host's mirror was given
    (etc/mirror.env), for those this shell does not set: the command fetches from the hub
    the mirror would. An unreadable file (another user's, 0600) gives none."""
    try:
        held = read_environment_file(layout.etc / "mirror.env")
    except (OSError, Error):
        return
    for key in HUB_ENV:
        if held.get(key):
            os.environ.setdefault(key, held[key])


def _mirror(args: argparse.Namespace) -> MirrorClient:
    """This host's mirror, answering: one that does not is said before anything is
    fetched."""
    mirror = mirror_client(Layout.for_mode(args.mode, args.state_dir), timeout=30.0)
    try:
        mirror.health()
    except Error as e:
        mirror.close()
        raise Error(f"the mirror does not answer at {shown_url(mirror.base_url)} ({e}); is "
                    "llmgw-mirror running? `pytest checks/` says what is wrong") from None
    return mirror


def _local(found: Path | Source, tmp: Path) -> ModelFile:
    if isinstance(found, Path):
        return read_local(found)
    shown = shown_url(found.spec)
    path = download(found, tmp, progress_lines(f"fetching {shown}"))
    return read_local(path, shown)


def _named(path: Path, tmp: Path) -> Path:
    """path under a name the mirror takes (a link in tmp when its own is not one)."""
    if is_name(path.name):
        return path
    link = tmp / (catalog_name(path.stem) or "model")
    link = link.with_name(f"{link.name}.gguf")
    link.symlink_to(path.resolve())
    return link


def _spec(args: argparse.Namespace, file: ModelFile, gpu_classes: list[str]) -> dict[str, Any]:
    name = args.name or catalog_name(file.general_name) or catalog_name(file.path.stem)
    if not name:
        raise Error(f"{file.shown} names no model (no general.name, and its file name has "
                    "no letters or digits); pass --name")
    least = 1 if args.min is None else args.min
    scaling: dict[str, int] = {"min": least,
                               "max": args.max if args.max is not None else max(1, least)}
    if args.idle is not None:
        scaling["idle_s"] = args.idle
    aliases = [a.strip() for given in args.alias or [] for a in given.split(",") if a.strip()]
    return {"name": name, "aliases": aliases,
            "description": f"added from {file.shown} by `llmgw models add`",
            "source": _PLACEHOLDER, "sha256": file.sha256, "scaling": scaling,
            "profiles": default_profiles(gpu_classes), "size_bytes": file.size,
            "geometry": dict(file.geometry)}


def _check(spec: Mapping[str, Any], catalog: list[ModelSpec]) -> None:
    """The catalog's own rules and names, before the mirror changes."""
    try:
        CATALOG_MODEL.validate_python(spec)
    except ValidationError as e:
        raise Error(f"the catalog would refuse {spec['name']}: {problems(e)}; change the "
                    "options (--name, --alias, --min, --max, --idle)") from None
    taken = {n for m in catalog for n in names(m)}
    clash = [n for n in [spec["name"], *spec["aliases"]] if n in taken]
    if clash:
        raise Error(f"{', '.join(clash)} already names a model in the catalog; pass another "
                    "--name (or --alias), or `llmgw models rm` it first")


def _said(added: ModelSpec, file: ModelFile, held: str, nodes: list[NodeView],
          replicas: list[PublicReplica], catalog: list[ModelSpec]) -> list[str]:
    aliases = f" (aliases {', '.join(added['aliases'])})" if added["aliases"] else ""
    scaling = ", ".join(f"{k} {v}" for k, v in added["scaling"].items())
    lines = [f"added {added['name']}{aliases} from {file.shown}: {file.size / (1 << 20):.1f} "
             f"MiB, sha256 {file.sha256[:16]}…, in the mirror as {held}; scaling {scaling}"]
    models = {m["name"]: m for m in catalog} | {added["name"]: added}
    # Imported here: the scheduler brings the store (SQLAlchemy), half a second on every
    # `llmgw` command's start if imported with the module.
    from llmgw.control.scheduler import place

    live: list[ReplicaRecord] = [
        {"id": r["id"], "model": r["model"], "node": r["node"], "profile": r["profile"],
         "state": r["state"], "gpus": r.get("gpus", [])} for r in replicas]
    first = place(added, nodes, live, models)
    if first.node:
        where = f"{first.node}, profile {first.profile}" + (
            f" on GPU {', '.join(first.gpus)}" if first.gpus else "")
        lines.append(f"runs on {where}; `llmgw status` shows its replicas come up"
                     if added["scaling"]["min"] else
                     f"min 0: no replica starts now; one would run on {where}")
    else:
        lines.append(f"no node can run it now: {first.why}")
    for profile in added["profiles"]:
        one = place({**added, "profiles": [profile]}, nodes, live, models)
        # place() says why for every profile; this one's reason alone, as it words it.
        why = one.why.removeprefix(f"no ready node fits any profile ({profile['name']}: ")
        why = why.removesuffix(")") if why != one.why else why
        lines.append(f"  profile {profile['name']}: "
                     + (f"fits {one.node}" if one.node else f"no node now: {why}"))
    return lines
