"""Day-2 commands: `llmgw status`, `models`, `logs`, `keys`, each through the admin API."""

from __future__ import annotations

import argparse

from llmgw.commands import keys, logs, models, status


def add_day2(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for module in (status, models, logs, keys):
        module.add_parser(sub)
