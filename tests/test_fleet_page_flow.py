"""The fleet page in a real browser (Debian's chromium, driven by Playwright) on a host
provisioned for real with a stand-in NVML (one H100): the sign-in form without a session;
the node, its GPU and the starter's replica turning ready; a killed engine shown not ready
within 15 s and ready again; a name made of markup shown as text, no dialog raised; no
request leaving 127.0.0.1; a viewer key that reads the page and changes nothing; the
Promises section saying how to turn the checks on until the first round reports. One host
for the whole module. Its picture goes to a temporary path: a test changes no tracked file.
docs/fleet-page.png, the picture docs/operations.md shows, is refreshed on purpose, with
LLMGW_REFRESH_PICTURE=1 (`bash scripts/fleet-page-picture` sets it and runs this module)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from llmgw.config import CHECK_INTERVAL_S, load_server
from llmgw.contract.catalog import CATALOG_MODEL
from llmgw.store import Store
from tests.hosts import ROOT, RunResult, ThrowawayHost

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
STANDIN = Path(__file__).parent / "standin_nvml"
# The picture docs/operations.md shows: copied there only when LLMGW_REFRESH_PICTURE=1.
DOC_PICTURE = ROOT / "docs" / "fleet-page.png"
REFRESH = "LLMGW_REFRESH_PICTURE"
MARKUP = "<img src=x onerror=alert(1)>"
# Chromium without anything that phones home; Playwright adds --headless itself.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]



def playwright_and_chromium() -> Any:
    """playwright.sync_api, where it and Debian's chromium are installed; skipped, saying
    what to install, where not and this is not root; as root (CI) `scripts/bootstrap`
    installs both, and their absence fails."""
    why = ""
    try:
        from playwright import sync_api
    except ImportError:
        why = "playwright is not installed: it is in the test extra (pip install -e '.[test]')"
    if not CHROMIUM.exists():
        why = f"{CHROMIUM} is missing: `apt-get install chromium`"
    if why:
        why += ", or run scripts/bootstrap as root"
        if os.geteuid() == 0:
            pytest.fail(why)
        pytest.skip(why)
    return sync_api


def until(what: str, predicate: Callable[[], Any], timeout_s: float,
          last: Callable[[], Any] = lambda: None, interval_s: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, \
            f"timed out after {timeout_s:.0f}s waiting for {what}; last seen: {last()!r}"
        time.sleep(interval_s)


class Provisioning:
    """`pytest provision/` running in a thread while the test watches the page."""

    def __init__(self, host: ThrowawayHost, *args: str, env: dict[str, str]) -> None:
        self.host, self.result = host, None
        self.thread = threading.Thread(target=self._run, args=(args, env), daemon=True)
        self.thread.start()

    def _run(self, args: tuple[str, ...], env: dict[str, str]) -> None:
        self.result = self.host.provision(*args, env=env)

    def finished(self) -> RunResult:
        self.thread.join(timeout=900)
        assert self.result is not None, "provisioning did not finish within 15 minutes"
        assert self.result.returncode == 0, self.result.output[-3000:]
        return self.result


@pytest.fixture(scope="module", autouse=True)
def doc_picture_kept() -> Iterator[None]:
    """Module: docs/fleet-page.png, a tracked file, reads the same after these tests as
    before, unless LLMGW_REFRESH_PICTURE=1 asked for a new one (then it must differ)."""
    before = DOC_PICTURE.read_bytes() if DOC_PICTURE.exists() else b""
    yield
    after = DOC_PICTURE.read_bytes() if DOC_PICTURE.exists() else b""
    if os.environ.get(REFRESH) == "1":
        assert after != before, f"{REFRESH}=1, and {DOC_PICTURE} was not refreshed"
    else:
        assert after == before, f"a test rewrote {DOC_PICTURE}; only {REFRESH}=1 may"


@pytest.fixture(scope="module")
def host(tmp_path_factory, tiny_gguf) -> Iterator[ThrowawayHost]:
    """Module: a host being provisioned (a thread runs `pytest provision/`; the admin API
    answers when this returns), with the stand-in NVML's H100 showing 30 GB used and a
    check round reported to the control plane (llmgw-check, which provision runs by
    default, on the free port ThrowawayHost gives it)."""
    root = tmp_path_factory.mktemp("fleet-page")
    nvml_state = root / "nvml.json"
    nvml_state.write_text(json.dumps({"used_mib": {"0": 30000}}))
    h = ThrowawayHost(root / "state")
    h.provisioning = Provisioning(
        h, f"--starter-source={tiny_gguf[0].as_uri()}", "-rf",
        env={"PYTHONPATH": str(STANDIN), "LLMGW_STANDIN_NVML_STATE": str(nvml_state)})
    try:
        until("the admin API to answer and the admin token to be written",
              lambda: h.token_path.exists() and _answers(f"{h.admin_url}/healthz"), 300,
              last=lambda: h.provisioning.result and h.provisioning.result.output[-2000:])
        yield h
    finally:
        h.provisioning.thread.join(timeout=900)
        h.down()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[Any]:
    """Module: a chromium context on a new, empty profile, recording every request any of
    its pages makes (context.requests) and every dialog raised (context.dialogs)."""
    sync_api = playwright_and_chromium()
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM),
            headless=True, args=ARGS, viewport={"width": 1200, "height": 900})
        context.requests, context.dialogs = [], []
        context.on("request", lambda r: context.requests.append(r.url))

        def dialog(d: Any) -> None:
            context.dialogs.append(d.message)
            d.dismiss()

        context.on("page", lambda p: p.on("dialog", dialog))
        try:
            yield context
        finally:
            context.close()


@pytest.fixture(scope="module")
def page(browser, host) -> Any:
    """Module: one tab on the host's fleet page, signed out."""
    tab = browser.new_page()
    tab.goto(f"{host.admin_url}/ui/")
    return tab


def sign_in(page: Any, credential: str) -> None:
    page.fill("#credential", credential)
    page.click("#sign-in-form button[type=submit]")
    page.wait_for_selector("#fleet:not([hidden])", timeout=10_000)


def replica_states(page: Any) -> dict[str, str]:
    """What the page shows now: replica id -> state, for every replica row."""
    return page.eval_on_selector_all(
        "tr[data-replica]", "rows => Object.fromEntries(rows.map("
        "r => [r.dataset.replica, r.dataset.state]))")


def live_replicas(host: ThrowawayHost) -> list[dict]:
    got = httpx.get(f"{host.admin_url}/api/v1/replicas", headers=host.auth, timeout=10)
    return [r for r in got.json() if r["state"] != "stopped"]


def test_without_a_session_the_page_is_the_sign_in_form_and_no_data(page, host) -> None:
    page.wait_for_selector("#sign-in:not([hidden])", timeout=10_000)
    assert page.is_hidden("#fleet")
    assert page.locator("[data-node], [data-replica]").count() == 0
    # The page's own fetch of the data it would draw: refused without a session.
    status = page.evaluate("fetch('/api/v1/nodes').then(r => r.status)")
    assert status == 401
    # The control: the same fetch with the admin token as a bearer is answered.
    status = page.evaluate("t => fetch('/api/v1/nodes', {headers: {Authorization: "
                           "'Bearer ' + t}}).then(r => r.status)", host.token)
    assert status == 200


def test_signed_in_it_shows_the_node_its_gpu_and_the_starter_turning_ready(
        page, host) -> None:
    sign_in(page, host.token)
    # Before the first round of checks (provision starts llmgw-check last): the Promises
    # section says that none report, and how the checks are turned on.
    none = page.locator("#drift-none")
    none.wait_for(timeout=10_000)
    how = none.inner_text()
    for words in ("No host reports its checks", "pytest provision/", "llmgw-check",
                  "--check-serve HOST:PORT", "--no-check-serve", "llmgw check --serve"):
        assert words in how, how
    seen: list[dict[str, str]] = []

    def starter_ready() -> bool:
        seen.append(replica_states(page))
        return "ready" in seen[-1].values()

    until("the page to show the starter's replica ready", starter_ready, 600,
          last=lambda: seen[-1] if seen else None, interval_s=0.5)
    assert seen[0] == {} or "ready" not in seen[0].values(), \
        f"the page first showed {seen[0]}: signed in after the starter was ready already"
    host.provisioning.finished()
    host.provisioned_at = time.monotonic()
    node = page.locator("[data-node]")
    assert node.count() == 1
    gpu = node.locator(".gpu")
    assert "NVIDIA H100 80GB HBM3" in gpu.inner_text() and "h100-80gb" in gpu.inner_text()
    assert "29.3 GB used" in gpu.inner_text(), gpu.inner_text()
    engines = {e.get_attribute("data-engine"): e.inner_text()
               for e in node.locator("li[data-engine]").all()}
    assert "ready" in engines["llamacpp"] and "llamacpp-cuda" in engines
    warnings = node.locator(".warning").all_inner_texts()
    assert any(w.startswith("!! ") and "llamacpp-cuda" in w for w in warnings), warnings
    # The control plane the node beats to, by the id the control planes' listing gives.
    [plane] = httpx.get(f"{host.admin_url}/api/v1/control-planes", headers=host.auth,
                        timeout=10).json()
    beats = node.locator("[data-control-plane]")
    assert beats.get_attribute("data-control-plane") == plane["id"], beats.inner_text()
    assert beats.inner_text() == f"beats to control plane {plane['id']}"
    # Why the starter is on CPU on a node with a GPU: its GPU engine failed (the stand-in
    # card has no CUDA driver), as the admin API's held_back says, in the replica's row.
    (replica,) = live_replicas(host)
    assert replica["profile"] == "cpu" and "(llamacpp-cuda) is not ready" in replica["held_back"]
    why = page.locator(f"tr[data-replica='{replica['id']}'] .why")
    until("the starter's row to say why it is not on the GPU",
          lambda: "(llamacpp-cuda) is not ready" in why.inner_text(), 10,
          last=lambda: why.inner_text())


def test_the_page_shows_traffic_promises_and_keys_and_a_picture_is_kept(
        page, host, tmp_path) -> None:
    """Traffic from real requests through the gateway; the check round's promises, with no
    how-to left; the owner's key with its usage (no secret anywhere on
    the page). The picture goes to tmp_path; LLMGW_REFRESH_PICTURE=1 copies it to docs/."""
    url = f"http://127.0.0.1:{host.ports['gateway']}/v1/chat/completions"
    for _ in range(6):
        httpx.post(url, headers={"Authorization": f"Bearer {host.gateway_key}"}, timeout=60,
                   json={"model": "qwen-0.5b", "max_tokens": 4,
                         "messages": [{"role": "user", "content": "hi"}]})
    httpx.post(url, headers={"Authorization": "Bearer sk-llmgw-wrong"}, timeout=10, json={})
    row = until("a request rate in the traffic table", lambda: _traffic_row(page), 30,
                last=lambda: page.inner_text("#traffic"))
    assert row[1] != "–" and row[2].endswith("ms"), row
    until("the check round's promises", lambda: page.locator("#drift tr[data-host]").count(),
          CHECK_INTERVAL_S, last=lambda: page.inner_text("#drift"))
    # The first round starts with llmgw-check, provision's last step: within one interval
    # of the default's (60 s) from the run's end, whatever interval this host was given.
    assert time.monotonic() - host.provisioned_at < CHECK_INTERVAL_S
    assert page.locator("#drift-none").count() == 0, "the how-to stays beside a report"
    assert page.locator("#keys tr[data-key=owner]").count() == 1
    assert host.gateway_key not in page.content() and host.token not in page.content()
    picture = tmp_path / "fleet-page.png"
    page.screenshot(path=str(picture), full_page=True, type="png")
    assert picture.stat().st_size > 10_000
    if os.environ.get(REFRESH) == "1":
        shutil.copyfile(picture, DOC_PICTURE)


def test_llmgw_status_shows_the_promises_the_page_shows(page, host) -> None:
    """The same round in `llmgw status`: a row for this host, its checked time and what
    holds or fails, as the page's Promises section has it."""
    import subprocess
    import sys

    rows = page.locator("#drift tr[data-host]").all()
    assert rows, page.inner_text("#drift")
    hosts = {r.get_attribute("data-host") for r in rows}
    status = subprocess.run([sys.executable, "-m", "llmgw", "status",
                             f"--state-dir={host.state_dir}"],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    table = status.stdout.split("HOST ", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert {line.split()[0] for line in table} == hosts, status.stdout
    shown = page.inner_text("#drift")
    for line in table:
        drift = line.split()[3] if "hold" not in line else " ".join(line.split()[3:6])
        assert drift in shown, (line, shown)


def _traffic_row(page: Any) -> list[str] | None:
    rows = page.locator("#traffic tr[data-traffic]").all()
    for r in rows:
        cells = r.locator("td").all_inner_texts()
        if cells[1] not in ("–", "0.00"):
            return cells
    return None


def test_a_killed_engine_is_shown_not_ready_within_15s_then_ready_again(page, host) -> None:
    (replica,) = live_replicas(host)
    rid = replica["id"]
    assert replica_states(page).get(rid) == "ready"
    records = list((host.state_dir / "lib" / "llmgw-agent" / "replicas").glob("*.json"))
    (pid,) = [json.loads(r.read_text())["pid"] for r in records]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    until(f"the page to show {rid} not ready", lambda: replica_states(page).get(rid,
          "gone") != "ready", 15, last=lambda: replica_states(page))
    shown_after = time.monotonic() - killed
    until(f"the page to show {rid} (or its successor) ready again",
          lambda: "ready" in replica_states(page).values(), 180,
          last=lambda: replica_states(page))
    assert shown_after < 15


def test_a_name_made_of_markup_is_shown_as_those_characters_and_raises_no_dialog(
        page, host, browser) -> None:
    """The admin API refuses such a model name; the page does not lean on that: a row put
    in the store directly (another writer, an older release) is drawn as text, and so is a
    promise of that name in a drift report (which the admin API takes as it comes)."""
    # Renamed after the check, as such a row would be; no replica (scaling.min 0).
    spec = CATALOG_MODEL.validate_python({
        "name": "x", "source": "http://127.0.0.1:1/x.gguf", "scaling": {"min": 0},
        "profiles": [{"name": "cpu", "engine": "llamacpp"}]})
    spec["name"] = MARKUP
    store = Store(load_server(host.state_dir / "etc" / "server.yaml").store_at())
    try:
        assert store.add_model(spec)
    finally:
        store.close()
    httpx.put(f"{host.admin_url}/api/v1/drift/xss-host", headers=host.auth, timeout=10,
              json={"checked": time.time(), "promises": 1,
                    "failing": [{"promise": MARKUP, "since": time.time(), "message": MARKUP}]})
    until("the model's name on the page", lambda: MARKUP in page.inner_text("#models"), 15,
          last=lambda: page.inner_text("#models"))
    assert MARKUP in page.inner_text("#drift")
    assert page.locator("img").count() == 0, "the name became an element"
    page.wait_for_timeout(1000)
    assert browser.dialogs == []
    # The controls: the same text put in as markup does become an element (and the page's
    # Content-Security-Policy still keeps its handler from running); a dialog is recorded.
    page.evaluate("m => { const d = document.createElement('div'); d.id = 'control'; "
                  "d.innerHTML = m; document.body.append(d); }", MARKUP)
    assert page.locator("#control img").count() == 1
    page.wait_for_timeout(1000)
    assert browser.dialogs == [], "an inline handler ran despite the CSP"
    page.evaluate("() => { document.getElementById('control').remove(); alert('control'); }")
    assert browser.dialogs == ["control"]
    browser.dialogs.clear()


def test_no_request_left_127_0_0_1(browser) -> None:
    assert browser.requests, "the request log recorded nothing"
    hosts = {urlsplit(u).hostname for u in browser.requests if not u.startswith("data:")}
    assert hosts == {"127.0.0.1"}, sorted(set(browser.requests))


def test_a_viewer_key_reads_the_page_and_changes_nothing(page, host, browser) -> None:
    made = httpx.post(f"{host.admin_url}/api/v1/viewers", headers=host.auth, timeout=10,
                      json={"name": "watcher"})
    assert made.status_code == 201, made.text
    key = made.json()["key"]
    keys_before = [k["name"] for k in admin_get(host, "/api/v1/keys")]
    page.click("#sign-out")
    page.wait_for_selector("#sign-in:not([hidden])", timeout=10_000)
    assert page.evaluate("fetch('/api/v1/nodes').then(r => r.status)") == 401
    sign_in(page, key)
    assert page.inner_text("#who") == "viewer: watcher"
    page.wait_for_selector("[data-node] .gpu", timeout=10_000)
    # Through the viewer's own session, and with the key as a bearer: every write is 403.
    for headers in ({}, {"Authorization": f"Bearer {key}"}):
        for method, path in (("POST", "/api/v1/keys"), ("DELETE", "/api/v1/models/qwen-0.5b"),
                             ("POST", "/api/v1/tokens"), ("POST", "/api/v1/viewers")):
            status, detail = page.evaluate(
                "([m, p, h]) => fetch(p, {method: m, headers: {...h, 'Content-Type': "
                "'application/json'}, body: '{}'}).then(async r => [r.status, "
                "(await r.json()).detail])", [method, path, headers])
            assert status == 403 and "only reads" in detail, (method, path, status, detail)
    # The control: the admin token as a bearer, from the same page, may write.
    status = page.evaluate("t => fetch('/api/v1/tokens', {method: 'POST', headers: "
                           "{Authorization: 'Bearer ' + t, 'Content-Type': 'application/json'}"
                           ", body: '{}'}).then(r => r.status)", host.token)
    assert status == 201
    assert "qwen-0.5b" in page.inner_text("#models"), "the starter is still there"
    assert [v["name"] for v in admin_get(host, "/api/v1/viewers")] == ["watcher"]
    assert keys_before == [k["name"] for k in admin_get(host, "/api/v1/keys")], "no key made"


def admin_get(host: ThrowawayHost, path: str) -> Any:
    got = httpx.get(f"{host.admin_url}{path}", headers=host.auth, timeout=10)
    assert got.status_code == 200, got.text
    return got.json()
