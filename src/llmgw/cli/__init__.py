"""The `llmgw` command (llmgw.cli.command) and its verbs, one module each.

`main` is the console script's entry (`llmgw = "llmgw.cli:main"`) and `python -m llmgw`'s;
it imports the command only when called, so a verb's module imports without the rest."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from llmgw.cli.command import main as command

    return command(argv)
