"""llmgw.host.pki: the CA, leaves and the checks that judge them."""

from __future__ import annotations

import datetime as dt
import stat

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from llmgw.host import pki


def test_server_cert_chains_names_and_matches_key() -> None:
    ca = pki.create_ca()
    leaf = pki.issue_server(ca, ["llm.example", "10.1.2.3", "::1"])
    assert pki.chains_to(leaf.cert, ca.cert)
    assert pki.san_names(leaf.cert) == {"llm.example", "10.1.2.3", "::1"}
    assert pki.missing_names(leaf.cert, ["llm.example", "0:0::1"]) == []
    assert pki.key_matches(leaf.cert, leaf.key)
    assert pki.has_usage(leaf.cert, ExtendedKeyUsageOID.SERVER_AUTH)
    assert not pki.has_client_auth(leaf.cert)


def test_the_ca_signs_certificates_and_crls_only_and_a_leaf_is_no_ca() -> None:
    """The constraints and usages every certificate is made with: the CA may sign leaves
    (path length 0) and CRLs, not agree keys; a leaf agrees keys and signs nothing."""
    ca = pki.create_ca()
    leaf = pki.issue_server(ca, ["a.example"])

    def marks(cert: x509.Certificate) -> tuple[bool, int | None, bool, bool, bool, bool]:
        basic = cert.extensions.get_extension_for_class(x509.BasicConstraints)
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
        assert basic.critical and usage.critical
        return (basic.value.ca, basic.value.path_length, usage.value.digital_signature,
                usage.value.key_agreement, usage.value.key_cert_sign, usage.value.crl_sign)

    assert marks(ca.cert) == (True, 0, True, False, True, True)
    assert marks(leaf.cert) == (False, None, True, True, False, False)
    assert ca.cert.issuer == ca.cert.subject and leaf.cert.issuer == ca.cert.subject
    assert leaf.cert.issuer != leaf.cert.subject, "negative control: a leaf is not self-issued"


def test_negative_controls_other_ca_other_key_missing_name() -> None:
    """Every check fails when its precondition is broken."""
    ca, other = pki.create_ca(), pki.create_ca()
    leaf = pki.issue_server(ca, ["a.example"])
    assert not pki.chains_to(leaf.cert, other.cert)
    assert not pki.key_matches(leaf.cert, pki.issue_server(ca, ["a.example"]).key)
    assert pki.missing_names(leaf.cert, ["a.example", "b.example"]) == ["b.example"]


def test_client_cert_carries_cn_and_client_auth() -> None:
    ca = pki.create_ca()
    leaf = pki.issue_client(ca, "node-7")
    assert pki.common_name(leaf.cert) == "node-7"
    assert pki.has_client_auth(leaf.cert)
    assert pki.san_names(leaf.cert) == set()


def test_expiry_window() -> None:
    ca = pki.create_ca()
    short = pki.issue_server(ca, ["x"], days=10)
    assert pki.expires_within(short.cert, 30)
    assert not pki.expires_within(pki.issue_server(ca, ["x"]).cert, 30)
    assert short.cert.not_valid_after_utc > dt.datetime.now(dt.UTC)


def test_keys_are_written_0600_and_load_back(tmp_path) -> None:
    ca = pki.create_ca()
    cert_path, key_path = ca.write(tmp_path, "ca")
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(cert_path.stat().st_mode) == 0o644
    loaded = pki.load_pair(tmp_path, "ca")
    assert loaded.cert == ca.cert and pki.key_matches(loaded.cert, loaded.key)


def test_unreadable_files_say_which(tmp_path) -> None:
    (tmp_path / "bad.pem").write_text("not a certificate")
    for load in (pki.load_cert, pki.load_key):
        try:
            load(tmp_path / "bad.pem")
        except pki.PKIError as e:
            assert "bad.pem" in str(e)
        else:
            raise AssertionError(f"{load.__name__} accepted garbage")
