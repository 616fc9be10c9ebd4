"""`pytest provision/` and `pytest checks/` on a throwaway host: the foundation steps."""

from __future__ import annotations

from tests.hosts import ThrowawayHost

FOUNDATION_ONLY = ("--no-mirror", "--no-node", "--no-starter")


def test_first_run_does_then_second_run_keeps(make_host) -> None:
    """A first provision reports done for CA, server cert, server.yaml and the service;
    a second reports only kept lines."""
    host: ThrowawayHost = make_host()
    first = host.provision(*FOUNDATION_ONLY)
    assert first.returncode == 0, first.output
    done = " ".join(first.lines("done"))
    for what in ("cluster CA", "server certificate", "server.yaml", "control plane started"):
        assert what in done, f"no done line for {what}: {first.steps}"

    second = host.provision(*FOUNDATION_ONLY)
    assert second.returncode == 0, second.output
    assert second.steps and "done" not in second.statuses(), second.steps
