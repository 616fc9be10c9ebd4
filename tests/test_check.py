"""`llmgw check`: the promises of `pytest checks/` run from the installed package, outside
the checkout, with one JSON record per promise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.hosts import ThrowawayHost

FOUNDATION_ONLY = ("--no-mirror", "--no-node", "--no-starter")


def llmgw_check(state_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", "check", f"--state-dir={state_dir}",
                           "--mode=local", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_check_outside_the_checkout_says_each_promise_as_json(make_host, tmp_path) -> None:
    host: ThrowawayHost = make_host()
    assert host.provision(*FOUNDATION_ONLY).returncode == 0
    ok = llmgw_check(host.state_dir, tmp_path, "--json")
    assert ok.returncode == 0, ok.stderr
    records = [json.loads(line) for line in ok.stdout.splitlines()]
    assert {r["status"] for r in records if r["step"] in ("pki", "control_plane")} == {"passed"}
    assert {(r["step"], r["promise"]) for r in records} >= {("pki", "ca-key-private"),
                                                           ("node", "ready")}
    assert all(set(r) == {"step", "promise", "status", "message"} for r in records)

    key = host.state_dir / "etc" / "pki" / "ca-key.pem"
    key.chmod(0o644)
    broken = llmgw_check(host.state_dir, tmp_path, "--json")
    assert broken.returncode == 1
    failed = [json.loads(line) for line in broken.stdout.splitlines()
              if json.loads(line)["status"] == "failed"]
    assert [(r["step"], r["promise"]) for r in failed] == [("pki", "ca-key-private")]
    assert f"{key} has mode 644" in failed[0]["message"]
    assert key.stat().st_mode & 0o777 == 0o644, "llmgw check changed the host"


def test_the_package_carries_every_llmgw_package_and_the_harness() -> None:
    """pyproject lists packages by hand: a new folder under src/llmgw or src/llmgw_harness
    must be added there too."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])
    on_disk = {".".join(p.parent.relative_to(root / "src").parts)
               for p in (root / "src").rglob("__init__.py")}
    assert on_disk == listed
