"""llmgw.httpclient, the one maker of control traffic's httpx clients, against a real TLS
server on loopback with certificates made here; and the rule that src/ makes none elsewhere."""

from __future__ import annotations

import ast
import asyncio
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from llmgw import httpclient as hc
from llmgw.errors import APIError
from llmgw.host import pki

ROOT = Path(__file__).resolve().parents[1]
SLOW_S = 0.5


class Files:
    def __init__(self, root: Path) -> None:
        ca = pki.create_ca("test CA")
        self.ca = root / "ca.pem"
        self.ca.write_bytes(ca.cert.public_bytes(Encoding.PEM))
        self.server, self.server_key = pki.issue_server(ca, ["127.0.0.1"]).write(root, "server")
        self.cert, self.key = pki.issue_client(ca, "node-1").write(root, "node")
        other = pki.create_ca("another CA")
        self.other_ca = root / "other-ca.pem"
        self.other_ca.write_bytes(other.cert.public_bytes(Encoding.PEM))


class Who(BaseHTTPRequestHandler):
    """Answers the common name of the client's certificate ('anonymous' without one);
    /slow answers after SLOW_S."""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path == "/slow":
            time.sleep(SLOW_S)
        peer = self.connection.getpeercert()
        names = [v for rdn in (peer or {}).get("subject", ()) for k, v in rdn
                 if k == "commonName"]
        body = (names[0] if names else "anonymous").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    return Files(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def url(files: Files) -> Iterator[str]:
    """https://127.0.0.1:PORT of a server presenting a certificate of files' CA, which
    asks for (but does not require) a client certificate of that CA."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Who)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(files.server, files.server_key)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    ctx.load_verify_locations(files.ca)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_client_trusting_the_ca_gets_an_answer_one_trusting_another_does_not(
        files: Files, url: str) -> None:
    with hc.client(url, verify=hc.tls(ca=files.ca)) as http:
        assert http.get("/").text == "anonymous"
    # Negative controls: another CA, and the system's roots, refuse the certificate.
    for verify in (hc.tls(ca=files.other_ca), True):
        with hc.client(url, verify=verify) as http, \
                pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            http.get("/")


def test_verify_off_takes_any_certificate(url: str) -> None:
    with hc.client(url, verify=False) as http:
        assert http.get("/").status_code == 200


def test_the_client_certificate_is_sent_with_mutual_tls(files: Files, url: str) -> None:
    mutual = hc.tls(ca=files.ca, cert=files.cert, key=files.key)
    with hc.client(url, verify=mutual) as http:
        assert http.get("/").text == "node-1"
    # Negative control: the same CA without the pair proves nobody.
    with hc.client(url, verify=hc.tls(ca=files.ca)) as http:
        assert http.get("/").text == "anonymous"


def test_tls_names_a_missing_file_for_the_caller_to_explain(files: Files) -> None:
    with pytest.raises(OSError):
        hc.tls(ca=files.ca, cert=files.ca.parent / "absent.pem", key=files.key)
    assert isinstance(hc.tls(ca=files.ca, cert=files.cert, key=files.key), ssl.SSLContext)


def test_the_async_client_is_made_alike(files: Files, url: str) -> None:
    async def who(verify: hc.Verify) -> str:
        async with hc.async_client(url, verify=verify) as http:
            return (await http.get("/")).text

    assert asyncio.run(who(hc.tls(ca=files.ca, cert=files.cert, key=files.key))) == "node-1"
    with pytest.raises(httpx.ConnectError):
        asyncio.run(who(hc.tls(ca=files.other_ca)))


def test_a_timeout_becomes_the_callers_error_saying_how_long_it_waited(
        files: Files, url: str) -> None:
    verify = hc.tls(ca=files.ca)
    with hc.client(url, verify=verify, timeout=0.1) as http, \
            pytest.raises(APIError) as caught:
        with hc.answered(APIError, f"the test server at {url}", asked="GET /slow",
                         timeout=0.1, then="; try again"):
            http.get("/slow")
    assert str(caught.value) == (f"the test server at {url} did not answer GET /slow within "
                                 "0.1s (ReadTimeout); try again")
    assert caught.value.status is None and isinstance(caught.value.__cause__,
                                                      httpx.ReadTimeout)
    # Negative control: given longer than the server takes, the same call answers.
    with hc.client(url, verify=verify, timeout=5.0) as http, \
            hc.answered(APIError, "the test server"):
        assert http.get("/slow").status_code == 200


def test_a_refused_connection_becomes_the_callers_error_in_httpx_words(
        files: Files, url: str) -> None:
    closed = f"https://127.0.0.1:{free_port()}"

    class Refused(APIError):
        pass

    with pytest.raises(Refused, match=r"^the test server at .* did not answer: "
                                      r".*Connection refused"):
        with hc.answered(Refused, f"the test server at {closed}", timeout=5.0):
            hc.request("GET", closed, verify=hc.tls(ca=files.ca))
    # Negative control: where something listens the same call answers, and nothing raises.
    with hc.answered(Refused, f"the test server at {url}", timeout=5.0):
        assert hc.request("GET", url, verify=hc.tls(ca=files.ca)).status_code == 200


def test_a_stream_reads_the_answer_as_it_comes(files: Files, url: str) -> None:
    with hc.stream("GET", url, verify=hc.tls(ca=files.ca)) as response:
        assert b"".join(response.iter_bytes()) == b"anonymous"


def test_reason_is_httpx_words_or_the_errors_name() -> None:
    assert hc.reason(httpx.ConnectError("[Errno 111] Connection refused")) == \
        "[Errno 111] Connection refused"
    assert hc.reason(httpx.ReadTimeout("")) == "ReadTimeout"
    assert hc.reason(httpx.ReadTimeout(""), 3.0) == "no answer within 3s (ReadTimeout)"
    # A timeout that sets its phases apart is told by the phase that ran out.
    phases = httpx.Timeout(10.0, connect=2.0, read=300.0)
    assert hc.reason(httpx.ConnectTimeout(""), phases) == "no answer within 2s (ConnectTimeout)"
    assert hc.reason(httpx.ReadTimeout(""), phases) == "no answer within 300s (ReadTimeout)"


# --- the rule: one maker ---

FACTORY = ROOT / "src" / "llmgw" / "httpclient.py"
MAKERS = {"Client", "AsyncClient", "get", "post", "put", "patch", "delete", "head",
          "options", "request", "stream"}


def makers(source: str) -> list[int]:
    """The lines of source that make an httpx client of their own (httpx.Client(...),
    httpx.get(...), or such a name imported from httpx)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "httpx"
                and node.func.attr in MAKERS):
            found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "httpx" and any(
                a.name in MAKERS for a in node.names):
            found.append(node.lineno)
    return sorted(found)


def test_no_module_of_src_but_the_factory_makes_an_httpx_client() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{line}"
                 for path in sorted((ROOT / "src").rglob("*.py")) if path != FACTORY
                 for line in makers(path.read_text())]
    assert not offenders, ("these make an httpx client of their own; make it with "
                           f"llmgw.httpclient (client, async_client, request, stream): "
                           f"{offenders}")


def test_the_rule_sees_every_way_to_make_one() -> None:
    # Negative controls: the factory itself is seen making both, and each spelling is found.
    assert len(makers(FACTORY.read_text())) == 2
    assert makers("import httpx\nhttpx.Client(timeout=1)\n") == [2]
    assert makers("import httpx\nr = httpx.get('http://x')\n") == [2]
    assert makers("from httpx import AsyncClient\n") == [1]
    assert makers("import httpx\nhttpx.Timeout(1.0)\nhttpx.Limits()\n") == []
