"""The fleet page in a real browser (Debian's chromium, driven by Playwright) against two
control planes of one fleet: signed in on one, the other's page opens signed in (a cookie
goes by host, not port, as behind a load balancer); its viewer key revoked on that other,
the first page says why the session ended at its next refresh."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.control.ui.conftest import Fleet
from tests.test_fleet_page_flow import ARGS, CHROMIUM, playwright_and_chromium, sign_in

SIGNED_IN = "#fleet:not([hidden])"
SIGNED_OUT = "#sign-in:not([hidden])"


def test_a_page_signed_in_on_one_control_plane_reads_another_and_says_why_it_ended(
        fleet: Fleet, tmp_path: Path) -> None:
    """(The control: before the revocation both pages stay signed in.)"""
    admin = {"Authorization": f"Bearer {fleet.token}"}
    key = httpx.post(f"{fleet.a}/api/v1/viewers", headers=admin,
                     json={"name": "oncall"}).json()["key"]
    sync_api = playwright_and_chromium()
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=str(CHROMIUM), headless=True,
            args=ARGS, viewport={"width": 1200, "height": 900})
        try:
            on_a = context.new_page()
            on_a.goto(f"{fleet.a}/ui/")
            sign_in(on_a, key)
            on_b = context.new_page()
            on_b.goto(f"{fleet.b}/ui/")
            on_b.wait_for_selector(SIGNED_IN, timeout=10_000)
            assert on_b.text_content("#who") == "viewer: oncall"
            on_a.wait_for_timeout(3500)  # a refresh of each page: still signed in
            assert on_a.is_visible("#fleet") and on_b.is_visible("#fleet")

            assert httpx.delete(f"{fleet.b}/api/v1/viewers/oncall",
                                headers=admin).status_code == 200
            on_a.wait_for_selector(SIGNED_OUT, timeout=10_000)
            said = on_a.text_content("#sign-in-error") or ""
            on_a.screenshot(path=str(tmp_path / "signed-out.png"))
            assert "the viewer key 'oncall' has been revoked" in said, said
            assert "Authorization" not in said, "the curl example is cut off"
        finally:
            context.close()
