"""The gateway against real loopback servers: routing, retries, byte-exact relays, errors."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from llmgw.config import ServerConfig
from llmgw.gateway._upstream import Timeouts, Upstream
from llmgw.gateway.app import Router, make_gateway_app
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.store import Store
from tests.servers import raw_server, refused_endpoint, scripted_upstream, serve_gateway

MODEL = {"name": "tiny", "aliases": ["tiny-chat"], "source": "http://m/tiny.gguf", "sha256": "",
         "scaling": {"min": 1, "max": 1},
         "profiles": [{"name": "cpu", "engine": "llamacpp", "gpu_class": "", "priority": 100,
                       "min_memory_gb": 0, "node_selector": {}, "args": []}]}
EMBED = {**MODEL, "name": "tiny-embed", "aliases": [], "routing_profile": "embedding"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
# Every character a line-splitting relay would cut on, and text a JSON round trip escapes.
AWKWARD = "a\u2028b\u2029c\u0085d é 漢字 \\u00e9 \"model\":\"x\""


@pytest.fixture
def store(tmp_path) -> Store:
    s = Store(tmp_path / "db.sqlite")
    s.add_model(MODEL)
    s.add_model(EMBED)
    return s


def ready(store: Store, rid: str, endpoint: str, key: str = "k", model: str = "tiny") -> None:
    store.put_replica({"id": rid, "model": model, "node": "n1", "profile": "cpu",
                       "state": "ready", "endpoint": endpoint, "api_key": key})


@contextmanager
def gateway(store: Store, tokens: list[str] | None = None, max_body_bytes: int = 1 << 20,
            metrics: GatewayMetrics | None = None,
            timeouts: Timeouts | None = None) -> Iterator[httpx.Client]:
    settings = ServerConfig(tokens=tokens or [], gateway_max_body_bytes=max_body_bytes)
    app = make_gateway_app(store, settings, upstream=Upstream(timeouts), metrics=metrics)
    with serve_gateway(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


def json_answer(model: str = "/models/tiny.gguf", content: str = "hello") -> bytes:
    body = {"choices": [{"message": {"content": content}}], "model": model,
            "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
    return json.dumps(body, ensure_ascii=False).encode()


def test_models_lists_names_and_aliases_with_the_catalog_time(store) -> None:
    with gateway(store) as gw:
        data = gw.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny", "tiny-chat", "tiny-embed"]
    assert all(m["created"] > 1_600_000_000 for m in data)


def test_one_model_by_name_or_alias_and_404_for_neither(store) -> None:
    with gateway(store) as gw:
        assert gw.get("/v1/models/tiny-chat").json()["root"] == "tiny"
        missing = gw.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/nope", 404), ("GET", "/", 404), ("GET", "/v1/chat/completions", 405),
    ("DELETE", "/v1/models", 405), ("PUT", "/v1/embeddings", 405),
])
def test_unknown_routes_and_methods_answer_in_openai_shape(store, method, path, status) -> None:
    with gateway(store) as gw:
        r = gw.request(method, path)
    assert r.status_code == status
    assert set(r.json()) == {"error"} and r.json()["error"]["message"]


def test_bodies_over_the_limit_are_413_and_bodies_without_a_model_422(store) -> None:
    with gateway(store, max_body_bytes=1000) as gw:
        big = gw.post("/v1/chat/completions", json={**CHAT, "pad": "x" * 2000})
        no_model = gw.post("/v1/chat/completions", json={"messages": []})
        not_object = gw.post("/v1/chat/completions", json=[1])
        not_json = gw.post("/v1/chat/completions", content=b"{nope")
    assert big.status_code == 413 and "1000 bytes" in big.json()["error"]["message"]
    assert no_model.status_code == 422 and no_model.json()["error"]["param"] == "model"
    assert not_object.status_code == 422
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"


def test_unknown_model_is_404_in_openai_shape(store) -> None:
    with gateway(store) as gw:
        r = gw.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and "nope" in r.json()["error"]["message"]


def test_no_ready_replica_is_503_naming_the_states(store) -> None:
    store.put_replica({"id": "r1", "model": "tiny", "node": "n1", "profile": "cpu",
                       "state": "downloading", "err": ""})
    with gateway(store) as gw:
        r = gw.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503
    assert "r1 on n1: downloading" in r.json()["error"]["message"]


def test_when_no_ready_replica_takes_the_request_the_503_says_why(store) -> None:
    ready(store, "r1", refused_endpoint())
    with gateway(store) as gw:
        r = gw.post("/v1/chat/completions", json=CHAT)
    message = r.json()["error"]["message"]
    assert r.status_code == 503 and "no replica of tiny could take the request" in message
    assert "r1 on n1: ready; the last one tried: cannot connect to 127.0.0.1:" in message


def test_a_chat_model_refuses_embeddings_and_an_embedding_model_chat(store) -> None:
    with gateway(store) as gw:
        wrong = gw.post("/v1/embeddings", json={"model": "tiny", "input": "hi"})
        also = gw.post("/v1/chat/completions", json={**CHAT, "model": "tiny-embed"})
    assert wrong.status_code == 400 and "/v1/embeddings" in wrong.json()["error"]["message"]
    assert also.status_code == 400 and also.json()["error"]["code"] == "wrong_model_kind"


@pytest.mark.parametrize("header", ["Bearer t0ken", "bearer t0ken", "BEARER  t0ken"])
def test_the_bearer_scheme_is_matched_in_any_case(store, header) -> None:
    with gateway(store, tokens=["t0ken"]) as gw:
        assert gw.get("/v1/models", headers={"Authorization": header}).status_code == 200


@pytest.mark.parametrize("header", [None, "Bearer nope", "Basic t0ken", "t0ken",
                                    "Bearer t0ken\u00e9".encode()])
def test_a_wrong_missing_or_non_ascii_key_is_401(store, header) -> None:
    with gateway(store, tokens=["t0ken"]) as gw:
        headers = {"Authorization": header} if header is not None else {}
        r = gw.get("/v1/models", headers=headers)
        chat = gw.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert chat.status_code == 401


def test_alias_routes_with_the_replica_key_which_never_leaves(store) -> None:
    """The upstream sees the client's bytes and the replica's own key; the client sees the
    model it asked for and never the key."""
    with scripted_upstream(lambda p, b: (200, "application/json", [json_answer()])) as up:
        ready(store, "r1", up.endpoint, key="k3y")
        sent = json.dumps({**CHAT, "model": "tiny-chat"}, indent=3).encode()
        with gateway(store) as gw:
            r = gw.post("/v1/chat/completions", content=sent)
    assert r.status_code == 200 and r.json()["model"] == "tiny-chat"
    assert up.seen[0].headers["Authorization"] == "Bearer k3y"
    assert up.seen[0].path == "/v1/chat/completions" and up.seen[0].body == sent
    assert "k3y" not in r.text


def test_an_answer_keeps_every_byte_but_the_model(store) -> None:
    raw = json_answer(content=AWKWARD)
    with scripted_upstream(lambda p, b: (200, "application/json", [raw[:7], raw[7:]])) as up:
        ready(store, "r1", up.endpoint)
        with gateway(store) as gw:
            r = gw.post("/v1/chat/completions", json=CHAT)
    assert r.content == raw.replace(b'"model": "/models/tiny.gguf"', b'"model":"tiny"')
    assert r.json()["choices"][0]["message"]["content"] == AWKWARD


def stream_events() -> list[bytes]:
    chunk = {"choices": [{"delta": {"content": AWKWARD}}], "model": "/m/tiny.gguf"}
    last = {"choices": [], "model": "/m/tiny.gguf",
            "usage": {"prompt_tokens": 2, "completion_tokens": 7}}
    return [b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n",
            b"data: " + json.dumps(last).encode() + b"\n\n", b"data: [DONE]\n\n"]


def test_a_stream_is_relayed_event_by_event_byte_for_byte(store) -> None:
    """Events cut across chunks arrive whole; U+2028, U+2029 and U+0085 cut nothing."""
    events = stream_events()
    wire = b"".join(events)
    parts = [wire[i:i + 5] for i in range(0, len(wire), 5)]
    with scripted_upstream(lambda p, b: (200, "text/event-stream", parts)) as up:
        ready(store, "r1", up.endpoint)
        with gateway(store) as gw, gw.stream("POST", "/v1/chat/completions",
                                             json={**CHAT, "stream": True}) as r:
            got = b"".join(r.iter_bytes())
    expected = b"".join(e.replace(b'"model": "/m/tiny.gguf"', b'"model":"tiny"')
                        for e in events)
    assert got == expected
    first = json.loads(got.split(b"\n\n")[0][len(b"data: "):])
    assert first["choices"][0]["delta"]["content"] == AWKWARD and first["model"] == "tiny"


def test_the_openai_client_reads_a_relayed_stream_whole(store) -> None:
    openai = pytest.importorskip("openai")
    with scripted_upstream(lambda p, b: (200, "text/event-stream", stream_events())) as up:
        ready(store, "r1", up.endpoint)
        with gateway(store) as gw:
            client = openai.OpenAI(base_url=f"{str(gw.base_url).rstrip('/')}/v1", api_key="x")
            chunks = list(client.chat.completions.create(
                model="tiny-chat", messages=[{"role": "user", "content": "hi"}], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == AWKWARD and {c.model for c in chunks} == {"tiny-chat"}


def test_a_refused_replica_is_skipped_for_a_live_one(store) -> None:
    with scripted_upstream(lambda p, b: (200, "application/json", [json_answer()])) as up:
        ready(store, "r1", refused_endpoint())
        ready(store, "r2", up.endpoint)
        with gateway(store) as gw:
            codes = [gw.post("/v1/completions", json=CHAT).status_code for _ in range(4)]
    assert codes == [200] * 4 and len(up.seen) == 4


def test_a_request_that_reached_a_replica_is_never_sent_again(store) -> None:
    """The replica took the request and hung up: 502, and the other replica never saw it
    (no generation runs twice)."""
    with scripted_upstream(lambda p, b: None) as dropper, \
            scripted_upstream(lambda p, b: (200, "application/json", [json_answer()])) as ok:
        ready(store, "r1", dropper.endpoint)
        ready(store, "r2", ok.endpoint)
        with gateway(store) as gw:
            # Four conversations: idle replicas take new ones in turn.
            codes = [gw.post("/v1/completions", json={**CHAT, "messages": [
                {"role": "user", "content": f"hi {i}"}]}).status_code for i in range(4)]
    assert sorted(codes) == [200, 200, 502, 502]
    assert len(dropper.seen) == 2 and len(ok.seen) == 2


def test_a_replica_error_is_passed_through_as_is(store) -> None:
    err = b'{"error":{"code":400,"message":"bad","type":"invalid_request_error"}}'
    with scripted_upstream(lambda p, b: (400, "application/json", [err])) as up:
        ready(store, "r1", up.endpoint)
        with gateway(store) as gw:
            r = gw.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 400 and r.content == err


def test_requests_and_tokens_are_counted_by_catalog_model(store) -> None:
    registry = CollectorRegistry()
    with scripted_upstream(lambda p, b: (200, "application/json", [json_answer()])) as up:
        ready(store, "r1", up.endpoint)
        with gateway(store, metrics=GatewayMetrics(registry)) as gw:
            gw.post("/v1/chat/completions", json={**CHAT, "model": "tiny-chat"})
            gw.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    text = generate_latest(registry).decode()
    assert 'llmgw_gateway_requests_total{key="",model="tiny",status="200"} 1.0' in text
    assert 'llmgw_gateway_tokens_total{key="",kind="completion",model="tiny"} 5.0' in text
    assert 'llmgw_gateway_requests_in_flight 0.0' in text
    assert 'model="nope"' not in text  # client-chosen names never become labels
    assert 'llmgw_gateway_requests_total{key="",model="",status="404"} 1.0' in text


def test_a_client_that_leaves_a_stream_hangs_up_on_the_replica(store) -> None:
    """The replica's stream never ends by itself; when the client goes, the gateway closes
    its connection to the replica, which is how llama-server learns to stop generating."""
    import threading

    hung_up = threading.Event()

    def endless(path: str, body: bytes) -> tuple[int, str, list[bytes]]:
        def events():
            event = b'data: {"choices":[],"model":"m"}\n\n'
            try:
                for _ in range(3000):
                    yield event
                    time.sleep(0.01)
            finally:
                hung_up.set()
        return 200, "text/event-stream", events()

    with scripted_upstream(endless) as up:
        ready(store, "r1", up.endpoint)
        with gateway(store) as gw:
            with gw.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                first = next(r.iter_bytes())
            assert first.startswith(b"data: ")
            assert hung_up.wait(10), "the gateway kept reading after its client left"


def test_the_read_timeout_from_server_yaml_ends_a_silent_replica_with_502(store) -> None:
    """A replica that takes the request and says nothing is given read_s, not forever."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        ready(store, "r1", f"http://127.0.0.1:{silent.getsockname()[1]}")
        with gateway(store, timeouts=Timeouts(connect_s=1.0, read_s=0.5)) as gw:
            r = gw.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 502
    assert "no answer within 0.5 s (upstream_read_timeout_s" in r.json()["error"]["message"]


def breaks_off_after_one_event(hang_up: bool) -> Callable[[socket.socket], None]:
    """A replica that streams one event and then hangs up (hang_up), or ends the stream
    as an engine does (the control)."""
    event = b'data: {"model":"/models/tiny.gguf","choices":[{"delta":{"content":"x"}}]}\n\n'

    def answer(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n" +
                         f"{len(event):x}\r\n".encode() + event + b"\r\n")
            if not hang_up:
                done = b"data: [DONE]\n\n"
                conn.sendall(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")
                conn.recv(65536)

    return answer


@pytest.mark.parametrize("hang_up", [True, False])
def test_a_stream_the_replica_breaks_off_ends_with_an_error_event(store, hang_up) -> None:
    """The status went out with the first byte, so a replica that dies mid-stream is said
    in the stream: an error event in OpenAI's shape (its SDK raises it) naming the replica
    and that nothing was resent, never a silent end. Control: a stream the replica ends
    has its [DONE] and no error."""
    with raw_server(breaks_off_after_one_event(hang_up)) as endpoint:
        ready(store, "r1", endpoint)
        with gateway(store) as gw:
            r = gw.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert r.status_code == 200 and json.loads(events[0])["model"] == "tiny", r.text
    if not hang_up:
        assert events[1:] == ["[DONE]"], r.text
        return
    assert len(events) == 2 and "[DONE]" not in r.text, r.text
    error = json.loads(events[1])["error"]
    assert error["code"] == "replica_failed", error
    assert "replica r1 of tiny failed while answering" in error["message"], error
    assert "not retried" in error["message"], error


@contextmanager
def closes_after_each_answer() -> Iterator[tuple[str, list[bytes]]]:
    """A replica that answers the first request of each connection with keep-alive headers
    and hangs up on the next one without a byte of an answer, as a connection the engine
    dropped while it sat in the gateway's pool looks from the gateway."""
    seen: list[bytes] = []
    body = json_answer()

    def answer_once(conn: socket.socket) -> None:
        with conn:
            seen.append(conn.recv(65536))
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            conn.recv(65536)  # the next request on this connection: hung up on, unread

    with raw_server(answer_once) as endpoint:
        yield endpoint, seen


def test_a_pooled_connection_the_replica_closed_is_sent_once_on_a_new_one(store) -> None:
    """No byte of an answer came on a reused connection the replica had closed: the request
    never reached a live engine, so it goes once on a new connection (200, seen once)."""
    with closes_after_each_answer() as (endpoint, seen):
        ready(store, "r1", endpoint)
        with gateway(store) as gw:
            first = gw.post("/v1/completions", json=CHAT).status_code
            second = gw.post("/v1/completions", json=CHAT).status_code
    posts = [s for s in seen if s.startswith(b"POST")]  # not the balancer's GET /slots
    assert (first, second) == (200, 200) and len(posts) == 2


def test_the_routing_table_outlives_a_store_that_cannot_be_read(tmp_path, caplog) -> None:
    """The control plane's file replaced by one that is no database (as mid-restore): the
    gateway keeps its last table and says so once; a readable file again, and it reads it."""
    path = tmp_path / "control.db"
    writer = Store(path)
    writer.add_model(MODEL)
    ready(writer, "r1", "http://127.0.0.1:1")
    writer.checkpoint()
    writer.close()
    good = path.read_bytes()
    router = Router(Store(path, busy_timeout_s=0.2), ttl_s=0)

    def on_a_new_thread(call: Callable[[], object]) -> object:
        # Each thread reads through a connection of its own, opened on first use.
        got: list[object] = []
        thread = threading.Thread(target=lambda: got.append(call()))
        thread.start()
        thread.join(10)
        return got[0]

    assert on_a_new_thread(lambda: router.resolve("tiny-chat"))["name"] == "tiny"
    (tmp_path / "junk").write_bytes(b"this is not a database " * 200)
    os.replace(tmp_path / "junk", path)
    with caplog.at_level("WARNING", logger="llmgw.gateway"):
        for _ in range(2):
            assert on_a_new_thread(lambda: router.resolve("tiny-chat"))["name"] == "tiny"
            assert [r["id"] for r in on_a_new_thread(lambda: router.ready("tiny"))] == ["r1"]
    said = [r.getMessage() for r in caplog.records if "routing table" in r.getMessage()]
    assert len(said) == 1 and "serving from the last one read" in said[0], said
    assert router.stale_since is not None
    path.write_bytes(good)
    on_a_new_thread(lambda: router.resolve("tiny"))
    assert router.stale_since is None
