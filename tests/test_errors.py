"""Every exception class llmgw and its harness define is below llmgw.errors.Error, where
errors.py's tree names it under its base: one place to read the whole hierarchy, and one
`except Error` that catches whatever llmgw raises."""

from __future__ import annotations

import importlib
import re

import pytest

import llmgw.errors
import llmgw_harness
from llmgw.errors import Error, shown_url
from tests.sourceclasses import classes_of, llmgw_modules

_ENTRY = re.compile(r"^(?P<indent>[ │]*)[├└]── (?P<name>[A-Za-z_][\w.]*)")
# Outside the tree as errors.py says why: the prebuilt engine's venv has no llmgw.
OUTSIDE = {"llmgw.agent.engines.prebuilt_server.UsageError"}


def tree(doc: str) -> dict[str, str]:
    """Each name the tree lists, with the name it is drawn under ("Error" at the top)."""
    parents: dict[str, str] = {}
    above = [(-1, "Error")]
    for line in doc.splitlines():
        entry = _ENTRY.match(line)
        if entry is None:
            continue
        depth = len(entry["indent"])
        while above[-1][0] >= depth:
            above.pop()
        parents[entry["name"]] = above[-1][1]
        above.append((depth, entry["name"]))
    return parents


def resolve(name: str) -> type | None:
    """The class a tree entry names (`mirror.MirrorError` is llmgw.mirror's MirrorError;
    `llmgw_harness._registry.RegistryError` the harness's; a bare name is errors.py's own),
    None where there is none."""
    module, _, cls = f"errors.{name}".rpartition(".") if "." not in name \
        else name.rpartition(".")
    if not module.startswith("llmgw_harness"):
        module = f"llmgw.{module}"
    try:
        found = getattr(importlib.import_module(module), cls, None)
    except ImportError:
        return None
    return found if isinstance(found, type) else None


def misplaced(classes: list[type], doc: str) -> list[str]:
    """What breaks the rule: an exception class not below Error, one the tree does not
    list, an entry naming no class, one drawn under a class it does not derive from."""
    parents = tree(doc)
    listed = {resolve(name): name for name in parents}
    found = [f"the tree names {name}, which is no class" for name in parents
             if resolve(name) is None]
    for c in classes:
        where = f"{c.__module__}.{c.__name__}"
        if not issubclass(c, BaseException) or c.__name__.startswith("_") \
                or where in OUTSIDE or c is Error:
            continue
        if not issubclass(c, Error):
            found.append(f"{where} is not an llmgw.errors.Error")
        elif c not in listed:
            found.append(f"{where} is not in errors.py's tree")
    for name, parent in parents.items():
        c, base = resolve(name), resolve(parent)
        if c is not None and base is not None and not issubclass(c, base):
            found.append(f"the tree draws {name} under {parent}, which it does not derive from")
    return found


def test_every_exception_class_is_an_error_named_in_the_tree() -> None:
    assert misplaced(classes_of(llmgw_modules()), llmgw.errors.__doc__ or "") == []


def test_every_harness_exception_class_is_an_error_named_in_the_tree() -> None:
    """The harness's errors (a registry that contradicts itself, a host that did not come
    up, a fix that cannot do its job) are in the same tree: one `except Error` for both."""
    assert misplaced(classes_of(llmgw_modules(llmgw_harness)), llmgw.errors.__doc__ or "") == []


def test_negative_control_the_walk_reports_a_stray_exception_in_the_harness(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An Exception subclass a harness module defines outside Error is reported."""
    from llmgw_harness import _registry

    stray = type("StrayError", (Exception,), {"__module__": _registry.__name__})
    monkeypatch.setattr(_registry, "StrayError", stray, raising=False)
    assert misplaced(classes_of(llmgw_modules(llmgw_harness)), llmgw.errors.__doc__ or "") == [
        "llmgw_harness._registry.StrayError is not an llmgw.errors.Error"]


class Stray(Exception):
    pass


class Unlisted(Error):
    pass


def test_negative_control_a_stray_an_unlisted_and_a_misdrawn_class_are_found() -> None:
    doc = ("Error\n ├── host.pki.PKIError\n └── APIError\n      ├── control.client.NotFound\n"
           "      └── host.pki.PKIError2\n └── config.ConfigError\n")
    assert tree(doc) == {"host.pki.PKIError": "Error", "APIError": "Error",
                         "control.client.NotFound": "APIError", "host.pki.PKIError2": "APIError",
                         "config.ConfigError": "Error"}
    from llmgw.host.pki import PKIError

    assert misplaced([Stray, Unlisted, PKIError], doc) == [
        "the tree names host.pki.PKIError2, which is no class",
        "tests.test_errors.Stray is not an llmgw.errors.Error",
        "tests.test_errors.Unlisted is not in errors.py's tree",
    ]
    wrong = doc.replace("control.client.NotFound", "host.pki.PKIError")
    assert "the tree draws host.pki.PKIError under APIError, which it does not derive from" \
        in misplaced([], wrong)


@pytest.mark.parametrize(("given", "shown"), [
    ("http://proxyuser:s3cret@127.0.0.1:3128", "http://127.0.0.1:3128"),
    ("https://hf_tok3n@hub.example:8443/", "https://hub.example:8443/"),
    ("postgresql://llmgw:s3cret@db:5432/llmgw", "postgresql://db:5432/llmgw"),
    ("https://u:p%40ss@[fd00::2]:7443/x.gguf", "https://[fd00::2]:7443/x.gguf"),
    ("https://cdn.example/x.gguf?X-Amz-Signature=s3cret#f", "https://cdn.example/x.gguf?…"),
    ("postgresql://db/llmgw?password=s3cret", "postgresql://db/llmgw?…"),
    ("http://u:pa/s3cret@host:1", "http://(a URL that does not parse)"),
    ("http://u:s3cret?x@host:1", "http://(a URL that does not parse)"),
])
def test_a_url_is_shown_with_its_scheme_host_port_and_path_never_its_credentials(
        given: str, shown: str) -> None:
    assert shown_url(given) == shown
    assert "s3cret" not in shown_url(given) and "tok3n" not in shown_url(given)


@pytest.mark.parametrize("plain", [
    "http://127.0.0.1:3128", "https://huggingface.co", "file:///srv/model.gguf",
    "hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf",
    "/var/lib/llmgw/control.db", "https://[::1]:7443/api/v1/models", "another machine",
])
def test_negative_control_a_url_without_credentials_is_shown_as_it_is(plain: str) -> None:
    assert shown_url(plain) == plain
