"""Lines a person watches, written to pytest's terminal as they happen (both plugins)."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def echo(config: pytest.Config) -> Callable[[str], None]:
    """A function that writes one line to the terminal past capture; nothing without one."""

    def write(line: str) -> None:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        capture = config.pluginmanager.get_plugin("capturemanager")
        if reporter is None:
            return
        if capture is None:
            reporter.write_line(line)
            return
        with capture.global_and_fixture_disabled():
            # On the terminal writer itself: the reporter's write_line resets the current
            # file, and pytest would write the file name again before every test.
            tw = config.get_terminal_writer()
            if tw.width_of_current_line:
                tw.line()
            tw.line(line)

    return write
