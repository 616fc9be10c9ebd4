"""Day-2 commands: `llmgw status`, `llmgw models`, `llmgw logs`, each through the admin API."""

from __future__ import annotations

import argparse

from llmgw.commands import logs, models, status


def add_day2(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for module in (status, models, logs):
        module.add_parser(sub)
