"""Certificates of a test cluster for the split replicas' relays, made at run time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from llmgw.config import TLSFiles
from llmgw.host import pki


@dataclass
class Cluster:
    """TLS files of a cluster CA's nodes (main-1, worker-1, intruder) and of another CA's
    main-1, each as agent.yaml's tls section would name them; the cluster CA (with its key,
    to sign revocation lists)."""

    files: dict[str, TLSFiles]
    ca: pki.KeyPair


def make_cluster(d: Path) -> Cluster:
    """A cluster CA and another one, and the node certificates of Cluster, written in d."""
    ca, other_ca = pki.create_ca(), pki.create_ca("another cluster")
    ca_path = d / "ca.pem"
    ca_path.write_bytes(ca.cert.public_bytes(serialization.Encoding.PEM))
    other_path = d / "other-ca.pem"
    other_path.write_bytes(other_ca.cert.public_bytes(serialization.Encoding.PEM))
    files = {}
    for stem, issuer, ca_file, cn in (("main-1", ca, ca_path, "main-1"),
                                      ("worker-1", ca, ca_path, "worker-1"),
                                      ("intruder", ca, ca_path, "intruder"),
                                      ("foreign-main-1", other_ca, other_path, "main-1")):
        cert, key = pki.issue_client(issuer, cn).write(d, stem)
        files[stem] = TLSFiles(ca=str(ca_file), cert=str(cert), key=str(key))
    return Cluster(files, ca)
