"""The cluster's revocation list as this agent holds it: fetched from the control plane,
checked against the cluster CA, kept fresh, and read by the RPC relays (a removed node's
certificate admits it nowhere, and a relay already open to it is closed)."""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from llmgw.errors import Error
from llmgw.host import pki

log = logging.getLogger("llmgw.agent.revocation")

# How often the agent asks the control plane for its list: a removed node loses its relays
# within this (and at once where the agent refreshes after a heartbeat).
REFRESH_S = 60.0


class RevocationError(Error):
    """A revocation list that is not this cluster's, or cannot be read; the message says
    which and what to do."""


class Revocations:
    """The serials the cluster CA revoked, as of the last list taken. update() takes a
    newer list (PEM, signed by the CA), crl_file() is it on disk for OpenSSL, and a
    listener added with on_change() is called (with no lock held) whenever it names a
    serial the one before did not."""

    def __init__(self, ca_file: str) -> None:
        try:
            self.ca = pki.load_cert(ca_file)
        except (OSError, pki.PKIError) as e:
            raise RevocationError(f"cannot load the cluster CA {ca_file} to check revocation "
                                  f"lists against: {e}; run `pytest provision/` to issue "
                                  "the node's TLS files") from e
        self._lock = threading.Lock()
        self._serials: frozenset[int] = frozenset()
        self._listeners: list[Callable[[], None]] = []
        self._dir = tempfile.TemporaryDirectory(prefix="llmgw-crl-")
        self._file: Path | None = None
        self._taken = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._every_s = REFRESH_S

    def revoked(self, cert: x509.Certificate) -> bool:
        return cert.serial_number in self._serials

    @property
    def serials(self) -> frozenset[int]:
        return self._serials

    def crl_file(self) -> str | None:
        """The last list taken, as a PEM file OpenSSL loads; None before any."""
        return str(self._file) if self._file is not None else None

    def on_change(self, listener: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def off_change(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def update(self, crl_pem: bytes) -> bool:
        """Take crl_pem, the control plane's list; whether it revoked a serial the last one
        did not (then the listeners were called). RevocationError where it is not a list
        the cluster CA signed."""
        try:
            crl = x509.load_pem_x509_crl(crl_pem)
        except ValueError as e:
            raise RevocationError(f"the control plane's revocation list does not parse: {e}; "
                                  "is the control plane this llmgw's?") from e
        public = self.ca.public_key()
        if crl.issuer != self.ca.subject or not (
                isinstance(public, ec.EllipticCurvePublicKey) and crl.is_signature_valid(public)):
            raise RevocationError(
                f"the revocation list names issuer {crl.issuer.rfc4514_string()!r} and is not "
                f"signed by this node's cluster CA ({pki.common_name(self.ca)!r}); it was "
                "ignored. Check that agent.yaml's tls.ca is the control plane's CA")
        serials = frozenset(r.serial_number for r in crl)
        with self._lock:
            added = serials - self._serials
            self._taken += 1
            path = Path(self._dir.name) / f"crl-{self._taken}.pem"
            path.write_bytes(crl_pem)
            old, self._file, self._serials = self._file, path, serials
            listeners = list(self._listeners) if added else []
        if old is not None:
            old.unlink(missing_ok=True)
        for listener in listeners:
            try:
                listener()
            except Exception:
                log.exception("a revocation listener failed")
        return bool(added)

    def refresh(self, fetch: Callable[[], bytes]) -> bool:
        """fetch() (the control plane's list) taken; False when it fails: the list held
        stays in force, and the log says so once a run of failures (and when it ends)."""
        try:
            changed = self.update(fetch())
        except Exception as e:  # noqa: BLE001 - a control plane away must not stop the loop
            if not self._failing:
                log.warning("could not refresh the cluster's revocation list: %s; the one "
                            "held (%d revoked) stays in force, and it is asked for again "
                            "every %.0f s", e, len(self._serials), self._every_s)
            self._failing = True
            return False
        if self._failing:
            log.info("the cluster's revocation list is fresh again (%d revoked)",
                     len(self._serials))
        self._failing = False
        return changed

    def keep_fresh(self, fetch: Callable[[], bytes], every_s: float = REFRESH_S) -> None:
        """refresh(fetch) now and every every_s in a thread of its own, until stop()."""
        self._every_s = every_s
        def loop() -> None:
            while True:
                self.refresh(fetch)
                if self._stop.wait(every_s):
                    return

        self._thread = threading.Thread(target=loop, name="revocations", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        self._dir.cleanup()



def kept_fresh(fetch: Callable[[], bytes], ca_file: str,
               every_s: float = REFRESH_S) -> Revocations:
    """The agent's list: fetch (its AgentClient's revocation_list) now and every every_s;
    stop() it when the agent stops."""
    revocations = Revocations(ca_file)
    revocations.keep_fresh(fetch, every_s)
    return revocations
