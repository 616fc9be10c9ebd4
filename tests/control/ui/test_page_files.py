"""The fleet page's files, as the package carries them: nothing from another host, no
inline script or style (the Content-Security-Policy would refuse it), and data drawn as
text only. Each rule is tried on a file that breaks it, so a rule that cannot fail is seen."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmgw.control.ui import STATIC

# What would put data in as markup, or run text as code.
AS_MARKUP = re.compile(r"\binnerHTML\b|\bouterHTML\b|insertAdjacentHTML|document\.write|"
                       r"\beval\(|new Function\(|setAttribute\(\s*[\"']on")
ELSEWHERE = re.compile(r"(?:https?:)?//[A-Za-z0-9.-]+\.[A-Za-z]{2,}|@import|url\(\s*[\"']?http")
INLINE = re.compile(r"<script(?![^>]*\bsrc=)[^>]*>|\son[a-z]+\s*=|\sstyle\s*=|<style\b"
                    r"|javascript:", re.IGNORECASE)


def problems(name: str, text: str) -> list[str]:
    found = []
    if ELSEWHERE.search(text):
        found.append(f"{name} names another host: {ELSEWHERE.search(text)[0]!r}")
    if name.endswith(".js") and AS_MARKUP.search(text):
        found.append(f"{name} makes markup from text: {AS_MARKUP.search(text)[0]!r}")
    if name.endswith(".html") and INLINE.search(text):
        found.append(f"{name} has inline code or style: {INLINE.search(text)[0]!r}")
    return found


def test_the_page_s_files_are_the_three_the_package_carries() -> None:
    assert sorted(p.name for p in STATIC.iterdir()) == ["app.js", "index.html", "style.css"]
    pyproject = (Path(__file__).parents[3] / "pyproject.toml").read_text()
    assert '"llmgw.control.ui" = ["static/*.html", "static/*.css", "static/*.js"]' in pyproject


def test_no_file_of_the_page_reaches_elsewhere_runs_inline_or_draws_data_as_markup() -> None:
    for path in sorted(STATIC.iterdir()):
        assert problems(path.name, path.read_text()) == []


@pytest.mark.parametrize(("name", "text"), [
    ("app.js", "row.innerHTML = model.name;"),
    ("app.js", 'fetch("https://cdn.example.com/x.js")'),
    ("index.html", "<script>alert(1)</script>"),
    ("index.html", '<button onclick="go()">'),
    ("index.html", '<div style="color: red">'),
    ("style.css", '@import url("https://fonts.example.org/a.css");'),
])
def test_each_rule_catches_what_it_is_for(name: str, text: str) -> None:
    assert problems(name, text)
