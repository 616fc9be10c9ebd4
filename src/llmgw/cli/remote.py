"""Checking a fleet over ssh: each host runs its own promises (`llmgw check --json` of
the llmgw installed there) through testinfra's ssh backend; the answers come back as one
record per host and promise."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import testinfra

CHECK_COMMAND = ("llmgw", "check", "--json")
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass(frozen=True)
class PromiseRecord:
    """One promise on one host, as `llmgw check --json` prints it there: one JSON object a
    line with step, promise, status (passed, failed or skipped) and message; unknown keys
    are kept in raw."""

    host: str
    step: str
    promise: str
    status: str
    message: str = ""
    raw: Mapping[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == PASSED

    @property
    def test_id(self) -> str:
        """The host in the id, so a failure says where: `a::node/agent-cert`."""
        return f"{self.host}::{self.step}/{self.promise}"


def parse_hosts(option: str) -> list[str]:
    """`--hosts ssh://root@a,ssh://root@b` → the host specs, in order, without repeats."""
    return list(dict.fromkeys(h.strip() for h in option.split(",") if h.strip()))


def check_host(spec: str, *, command: tuple[str, ...] = CHECK_COMMAND,
               **backend: Any) -> list[PromiseRecord]:
    """Run the host's own checks there; a host that cannot be reached or answers no JSON
    is one failed record saying so. backend: testinfra ssh options (ssh_config,
    ssh_identity_file, timeout, ...)."""
    host = testinfra.get_host(spec, **backend)
    name = host.backend.get_hostname()
    try:
        result = host.run(shlex.join(command))
    except Exception as e:  # any transport failure is the host's record, not a crash
        return [_unreachable(name, f"ssh to {spec} failed: {e}")]
    if result.rc == 255:
        return [_unreachable(name, f"ssh to {spec} failed (255): {result.stderr.strip()[-500:]}")]
    found = _records(result.stdout)
    if not found:
        return [_unreachable(name, f"`{shlex.join(command)}` on {spec} exited {result.rc} "
                                   "without a JSON record of any promise: "
                                   f"{(result.stderr or result.stdout).strip()[-500:]}; is "
                                   "llmgw installed there, and new enough to have `check`?")]
    return [_record(name, item) for item in found]


def _records(stdout: str) -> list[Mapping[str, object]]:
    """The JSON objects of stdout, one a line; other lines (there should be none) are left."""
    found: list[Mapping[str, object]] = []
    for line in stdout.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            found.append(item)
    return found


def check_hosts(specs: list[str], **backend: Any) -> list[PromiseRecord]:
    """Every host's records, host by host in the order given."""
    return [record for spec in specs for record in check_host(spec, **backend)]


def _record(host: str, item: Mapping[str, object]) -> PromiseRecord:
    status = str(item.get("status", ""))
    return PromiseRecord(host=host, step=str(item.get("step", "")),
                         promise=str(item.get("promise", "")),
                         status=status if status in (PASSED, SKIPPED) else FAILED,
                         message=str(item.get("message") or ""), raw=item)


def _unreachable(host: str, why: str) -> PromiseRecord:
    return PromiseRecord(host=host, step="ssh", promise="answers", status=FAILED, message=why)
