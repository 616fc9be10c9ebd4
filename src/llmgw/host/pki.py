"""A tiny cluster CA: the authority, server and client certificates, and their checks."""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.errors import Error
from llmgw.host.files import atomic_write

CA_DAYS = 3650
LEAF_DAYS = 825
_BACKDATE = dt.timedelta(minutes=5)


class PKIError(Error):
    """A certificate or key is missing, unreadable or does not fit."""


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def write(self, directory: str | os.PathLike[str], stem: str) -> tuple[Path, Path]:
        """Write STEM.pem (0644) and STEM-key.pem (0600) into directory."""
        directory = Path(directory)
        cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}-key.pem"
        atomic_write(key_path, key_pem(self.key), mode=0o600)
        atomic_write(cert_path, self.cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
        return cert_path, key_path


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmgw"),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


def create_ca(common_name: str = "llmgw cluster CA") -> KeyPair:
    """A new self-signed authority that may sign leaves only."""
    key = ec.generate_private_key(ec.SECP256R1())
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        _certificate(_name(common_name), _name(common_name), key.public_key(), CA_DAYS, ca=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert, key)


def _certificate(subject: x509.Name, issuer: x509.Name, public: ec.EllipticCurvePublicKey,
                 days: int, *, ca: bool) -> x509.CertificateBuilder:
    """What every certificate here has: its names and key, a random serial, days of
    validity (backdated a little), and whether it is a CA, with the key usage that goes with
    that (a CA signs certificates and CRLs; a leaf agrees keys)."""
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - _BACKDATE)
        .not_valid_after(_now() + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None),
                       critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=not ca, key_cert_sign=ca,
                crl_sign=ca, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
    )


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _builder(ca: KeyPair, cn: str, usage: x509.ObjectIdentifier,
             public: ec.EllipticCurvePublicKey, days: int) -> x509.CertificateBuilder:
    return (
        _certificate(_name(cn), ca.cert.subject, public, days, ca=False)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
    )


def _issue(
    ca: KeyPair, cn: str, usage: x509.ObjectIdentifier, sans: list[str], days: int
) -> KeyPair:
    key = new_key()
    builder = _builder(ca, cn, usage, key.public_key(), days)
    if sans:
        unique = list(dict.fromkeys(sans))
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_general_name(n) for n in unique]), critical=False
        )
    return KeyPair(builder.sign(ca.key, hashes.SHA256()), key)


def issue_server(ca: KeyPair, names: list[str], days: int = LEAF_DAYS) -> KeyPair:
    """A serverAuth certificate whose SANs are names (DNS names and IP addresses)."""
    if not names:
        raise PKIError("a server certificate needs at least one name; pass --advertise NAME")
    return _issue(ca, names[0], ExtendedKeyUsageOID.SERVER_AUTH, names, days)


def issue_client(ca: KeyPair, common_name: str, days: int = LEAF_DAYS) -> KeyPair:
    """A clientAuth certificate; its CN is the identity the control plane trusts."""
    return _issue(ca, common_name, ExtendedKeyUsageOID.CLIENT_AUTH, [], days)


def load_cert(path: str | os.PathLike[str]) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(Path(path).read_bytes())
    except (OSError, ValueError) as e:
        raise PKIError(f"cannot read the certificate {path}: {e}") from e


def load_key(path: str | os.PathLike[str]) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise PKIError(f"cannot read the private key {path}: {e}") from e
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PKIError(f"{path} holds a {type(key).__name__}, not an EC key llmgw wrote")
    return key


def load_pair(directory: str | os.PathLike[str], stem: str) -> KeyPair:
    directory = Path(directory)
    return KeyPair(load_cert(directory / f"{stem}.pem"), load_key(directory / f"{stem}-key.pem"))


# --- checks: each answers a question; the steps turn answers into messages ---


def chains_to(cert: x509.Certificate, ca_cert: x509.Certificate) -> bool:
    """Whether ca_cert signed cert."""
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def san_names(cert: x509.Certificate) -> set[str]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    names = set(ext.get_values_for_type(x509.DNSName))
    names.update(str(ip) for ip in ext.get_values_for_type(x509.IPAddress))
    return names


def missing_names(cert: x509.Certificate, names: list[str]) -> list[str]:
    """The names the certificate does not cover, in the order asked."""
    have = san_names(cert)
    return [n for n in names if _canonical(n) not in have]


def _canonical(name: str) -> str:
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


def common_name(cert: x509.Certificate) -> str:
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else ""


def has_usage(cert: x509.Certificate, usage: x509.ObjectIdentifier) -> bool:
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return False
    return usage in eku


def has_client_auth(cert: x509.Certificate) -> bool:
    return has_usage(cert, ExtendedKeyUsageOID.CLIENT_AUTH)


def expires_within(cert: x509.Certificate, days: int) -> bool:
    return cert.not_valid_after_utc <= _now() + dt.timedelta(days=days)


def key_matches(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> bool:
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return cert.public_key().public_bytes(*fmt) == key.public_key().public_bytes(*fmt)


# --- joining and renewing: the node makes its key, the control plane signs a CSR ---


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def make_csr(key: ec.EllipticCurvePrivateKey, common_name: str) -> bytes:
    """A PEM certificate request for common_name; the key never leaves the caller."""
    csr = x509.CertificateSigningRequestBuilder().subject_name(_name(common_name))
    return csr.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def sign_csr(ca: KeyPair, csr_pem: bytes, common_name: str,
             days: int = LEAF_DAYS) -> x509.Certificate:
    """A clientAuth certificate for the CSR's key, with CN = common_name whatever the CSR
    asks: the control plane decides who a node is."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as e:
        raise PKIError(f"the certificate request is not a PEM CSR: {e}") from e
    if not csr.is_signature_valid:
        raise PKIError("the certificate request's signature does not match its key")
    public = csr.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise PKIError(f"the certificate request holds a {type(public).__name__}; "
                       "llmgw signs EC P-256 keys only")
    return _builder(ca, common_name, ExtendedKeyUsageOID.CLIENT_AUTH, public, days).sign(
        ca.key, hashes.SHA256()
    )


def serial_hex(cert: x509.Certificate) -> str:
    """A serial as llmgw writes it everywhere (the store, the HTTP core's tls extension,
    revocation): upper-case hex of the integer, no leading zero."""
    return format(cert.serial_number, "X")


def ca_hash(ca_cert: x509.Certificate) -> str:
    """kubeadm's CA pin: sha256 of the CA's DER SubjectPublicKeyInfo, as sha256:HEX."""
    spki = ca_cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(spki).hexdigest()


def make_crl(ca: KeyPair, serials: list[str], days: int = CA_DAYS,
             last_update: dt.datetime | None = None) -> bytes:
    """A PEM revocation list of the serials (upper-case hex), signed by the CA."""
    now = _now()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.cert.subject)
        .last_update(last_update or now - _BACKDATE)
        .next_update(min(now + dt.timedelta(days=days), ca.cert.not_valid_after_utc))
    )
    for serial in sorted(set(serials)):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(int(serial, 16))
            .revocation_date(now - _BACKDATE).build()
        )
    return builder.sign(ca.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
