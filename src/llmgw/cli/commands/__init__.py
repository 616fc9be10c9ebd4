"""Day-2 commands: `llmgw status`, `models`, `logs`, `keys`, each through the admin API;
`backup`, `restore` and `store migrate`, on the control plane's own files."""

from __future__ import annotations

import argparse

from llmgw.cli.commands import backup, keys, logs, models, status


def add_day2(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for module in (status, models, logs, keys, backup):
        module.add_parser(sub)
