"""`llmgw models ls|add SOURCE|rm NAME`: the catalog. `add` takes a catalog model in YAML,
or a GGUF file (hf:, https://, a local file) it puts in the mirror and adds with the
starter's profiles."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from llmgw.cli.commands import _admin
from llmgw.cli.commands._add_file import FILE_OPTIONS, add_file, add_file_options
from llmgw.cli.commands._table import table
from llmgw.cli.model_source import is_model_source
from llmgw.contract import ReplicaState
from llmgw.errors import Error


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("models", help="the catalog: ls, add SOURCE|FILE.yaml, rm NAME")
    msub = p.add_subparsers(dest="models_command", required=True)
    ls = msub.add_parser("ls", help="list the catalog with each model's ready replicas")
    add = msub.add_parser("add", help="add a GGUF model (hf:ORG/REPO/FILE.gguf, an https URL "
                                      "or a local file), or the model a YAML file describes")
    add.add_argument("file", metavar="SOURCE",
                     help="hf:ORG/REPO/FILE.gguf[@REVISION], https://…/FILE.gguf or a local "
                          ".gguf file: fetched into the mirror, then added with a profile per "
                          "GPU class in the fleet and a CPU one; or a catalog model in YAML "
                          "(POST /api/v1/models)")
    add_file_options(add)
    rm = msub.add_parser("rm", help="remove a model; its replicas stop")
    rm.add_argument("name")
    for q, run in ((ls, _ls), (add, _add), (rm, _rm)):
        _admin.add_host_options(q)
        q.set_defaults(run=run)


def _ls(args: argparse.Namespace) -> int:
    with _admin.admin(args) as client:
        models = _admin.call(client, client.models)
        replicas = _admin.call(client, client.replicas)
    rows = []
    for m in models:
        mine = [r for r in replicas
                if r["model"] == m["name"] and r["state"] != ReplicaState.STOPPED]
        ready = sum(r["state"] == ReplicaState.READY for r in mine)
        rows.append([m["name"], ",".join(m.get("aliases", [])) or "-",
                     m.get("routing_profile", "chat"), f"{ready}/{len(mine)}", m["source"]])
    print(table(["NAME", "ALIASES", "ROUTING", "READY", "SOURCE"], rows, "no models"))
    return 0


def _add(args: argparse.Namespace) -> int:
    if is_model_source(args.file):
        return add_file(args)
    given = [f"--{o}" for o in FILE_OPTIONS if getattr(args, o) is not None]
    if given:
        raise Error(f"{', '.join(given)} apply to a model file; {args.file} is a catalog "
                    "model in YAML: write them in it (name, aliases, scaling)")
    try:
        spec = yaml.safe_load(Path(args.file).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise Error(f"cannot read {args.file}: {e}") from None
    if not isinstance(spec, dict):
        raise Error(f"{args.file} should hold one model as a mapping, found "
                    f"{type(spec).__name__}")
    with _admin.admin(args) as client:
        added = _admin.call(client, lambda: client.add_model(spec))
    print(f"added {added['name']}; `llmgw status` shows its replicas come up")
    return 0


def _rm(args: argparse.Namespace) -> int:
    with _admin.admin(args) as client:
        _admin.call(client, lambda: client.delete_model(args.name))
    print(f"removed {args.name}; its replicas stop within a few seconds")
    return 0
