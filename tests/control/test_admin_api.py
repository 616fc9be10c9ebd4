"""The admin API's catalog: validation answers 422 with the reason, duplicates 409."""

from __future__ import annotations

import copy

import pytest

MODEL = {
    "name": "tiny",
    "aliases": ["tiny-chat"],
    "source": "http://127.0.0.1:8081/tiny/1/tiny.gguf",
    "profiles": [{"name": "cpu", "engine": "llamacpp", "priority": 100}],
}


def _with(**changes: object) -> dict:
    model = copy.deepcopy(MODEL)
    model.update(changes)
    return model


def test_add_list_get_delete(live_control_plane) -> None:
    admin = live_control_plane.admin
    r = admin.post("/api/v1/models", json=MODEL)
    assert r.status_code == 201, r.text
    assert r.json()["scaling"] == {"min": 1, "max": 1, "idle_s": 900}
    # Listed with its state; none serves (no node here).
    assert [(m["name"], m["state"] != "serving") for m in admin.get("/api/v1/models").json()] \
        == [("tiny", True)]
    assert admin.get("/api/v1/models/tiny").json()["aliases"] == ["tiny-chat"]
    assert admin.delete("/api/v1/models/tiny").status_code == 204
    assert admin.get("/api/v1/models/tiny").status_code == 404
    assert admin.delete("/api/v1/models/tiny").status_code == 404


def test_duplicate_name_or_alias_is_409(live_control_plane) -> None:
    admin = live_control_plane.admin
    assert admin.post("/api/v1/models", json=MODEL).status_code == 201
    again = admin.post("/api/v1/models", json=MODEL)
    assert again.status_code == 409 and "tiny" in again.json()["detail"]
    alias_clash = admin.post("/api/v1/models", json=_with(name="other", aliases=["tiny-chat"]))
    assert alias_clash.status_code == 409


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (_with(name="Bad Name"), "lower-case"),
        (_with(source="ftp://x/y.gguf"), "source"),
        (_with(profiles=[]), "profiles"),
        (_with(profiles=[{"name": "x", "engine": "vllm"}]), "engine 'vllm' is unknown"),
        (_with(scaling={"min": 3, "max": 1}), "scaling.min (3) is above scaling.max (1)"),
        (_with(sha256="abc"), "64 lower-case hex"),
        (_with(source="file:///root/secret.gguf"), "llmgw mirror import"),
        (_with(unknown_field=1), "unknown_field"),
        ({k: v for k, v in MODEL.items() if k != "source"}, "source"),
    ],
)
def test_invalid_body_is_422_with_the_reason(live_control_plane, body, reason) -> None:
    r = live_control_plane.admin.post("/api/v1/models", json=body)
    assert r.status_code == 422
    assert reason in r.text, r.text
    assert live_control_plane.admin.get("/api/v1/models").json() == []


def test_replicas_never_show_their_api_key(live_control_plane) -> None:
    cp = live_control_plane
    cp.store.put_replica({"id": "r1", "model": "tiny", "node": "n", "profile": "cpu",
                          "state": "ready", "endpoint": "http://127.0.0.1:1", "api_key": "s3cret"})
    shown = cp.admin.get("/api/v1/replicas", params={"model": "tiny"}).json()
    assert shown[0]["id"] == "r1" and "api_key" not in shown[0]
    assert "s3cret" not in cp.admin.get("/api/v1/replicas").text


@pytest.mark.parametrize("flag", ["--api-key", "--host", "--log-file", "--model", "-m",
                                  "--port", "--lora", "--slot-save-path", "--path"])
def test_a_profile_flag_outside_the_allow_list_is_422_naming_it(live_control_plane, flag):
    """The agent appends profile args to a root process's command line: only flags that
    tune the model pass."""
    profile = {"name": "cpu", "engine": "llamacpp", "args": ["--ctx-size", "512", flag, "x"]}
    r = live_control_plane.admin.post("/api/v1/models", json=_with(profiles=[profile]))
    assert r.status_code == 422 and f"engine flag {flag} is not allowed" in r.text, r.text
    assert live_control_plane.admin.get("/api/v1/models").json() == []


def test_tuning_flags_pass(live_control_plane) -> None:
    """The negative control: flags that tune the model, with their values, are accepted."""
    args = ["-c", "4096", "--threads", "2", "-ngl", "-1", "--flash-attn", "auto",
            "--cache-type-k", "q8_0", "--rope-scaling", "yarn", "--embeddings",
            "--pooling", "mean", "--parallel", "4"]
    profile = {"name": "cpu", "engine": "llamacpp", "args": args}
    r = live_control_plane.admin.post("/api/v1/models", json=_with(profiles=[profile]))
    assert r.status_code == 201, r.text


@pytest.mark.parametrize("path", ["/api/v1/models", "/api/v1/nodes", "/api/v1/replicas",
                                  "/openapi.json", "/metrics", "/a/route/added/later"])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", "Basic abc", "Bearer "])
def test_without_the_admin_token_every_path_is_401_saying_where_it_is(
    live_control_plane, path, authorization
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    r = live_control_plane.anonymous().get(path, headers=headers)
    assert r.status_code == 401, r.text
    assert "admin-token" in r.json()["detail"] and "Authorization: Bearer" in r.json()["detail"]


def test_anonymous_writes_are_refused_and_change_nothing(live_control_plane) -> None:
    anon = live_control_plane.anonymous()
    assert anon.post("/api/v1/models", json=MODEL).status_code == 401
    assert anon.delete("/api/v1/models/tiny").status_code == 401
    assert live_control_plane.store.models() == []


def test_healthz_needs_no_token(live_control_plane) -> None:
    assert live_control_plane.anonymous().get("/healthz").json() == {"status": "ok"}


def test_nodes_paging_is_opt_in(live_control_plane) -> None:
    cp = live_control_plane
    for n in ["a", "b", "c"]:
        cp.store.record_heartbeat(n, {})
    assert [n["id"] for n in cp.admin.get("/api/v1/nodes").json()] == ["a", "b", "c"]
    page = cp.admin.get("/api/v1/nodes", params={"limit": 2}).json()
    assert [n["id"] for n in page] == ["a", "b"]
    rest = cp.admin.get("/api/v1/nodes", params={"limit": 2, "after": "b"}).json()
    assert [n["id"] for n in rest] == ["c"]
    assert cp.admin.get("/api/v1/nodes", params={"limit": 0}).status_code == 422


def test_tokens_need_a_positive_ttl(live_control_plane) -> None:
    r = live_control_plane.admin.post("/api/v1/tokens", json={"ttl_s": 0})
    assert r.status_code == 422


def test_openapi_names_the_node_and_replica_fields(live_control_plane) -> None:
    """The admin API declares its records, so clients read their shapes from /openapi.json;
    the public replica has no api_key there either."""
    schemas = live_control_plane.admin.get("/openapi.json").json()["components"]["schemas"]
    node, replica = schemas["NodeView"]["properties"], schemas["PublicReplica"]["properties"]
    assert {"id", "state", "engines", "gpus", "labels", "memory_mb", "last_seen"} <= set(node)

    def enum(prop: dict[str, str]) -> set[str]:
        return set(schemas[prop["$ref"].rpartition("/")[2]]["enum"])

    assert enum(node["state"]) == {"registering", "provisioning", "ready", "not_ready"}
    assert {"id", "model", "node", "profile", "state", "err", "endpoint"} <= set(replica)
    assert "stopped" in enum(replica["state"]) and "api_key" not in replica


def test_keys_are_made_listed_and_revoked_never_showing_a_secret_or_hash(
        live_control_plane) -> None:
    admin = live_control_plane.admin
    assert admin.post("/api/v1/models", json=MODEL).status_code == 201
    made = admin.post("/api/v1/keys", json={"name": "ci", "models": ["tiny-chat"], "rpm": 5})
    assert made.status_code == 201, made.text
    secret, stored = made.json()["key"], live_control_plane.store.keys()[0]
    listed = admin.get("/api/v1/keys")
    assert [k["name"] for k in listed.json()] == ["ci"]
    assert secret not in listed.text and stored["hash"] not in listed.text + made.text
    assert listed.json()[0]["models"] == ["tiny-chat"] and listed.json()[0]["requests"] == 0
    assert live_control_plane.anonymous().get("/api/v1/keys").status_code == 401
    assert live_control_plane.anonymous().post("/api/v1/keys", json={}).status_code == 401
    assert admin.delete(f"/api/v1/keys/{stored['prefix']}").json()["name"] == "ci"
    assert admin.get("/api/v1/keys").json() == []
    assert admin.delete("/api/v1/keys/ci").status_code == 404
    assert admin.post("/api/v1/keys", json={"rpm": -1}).status_code == 422


def test_a_hosts_drift_report_replaces_its_last_and_is_listed_by_host(live_control_plane):
    """PUT /api/v1/drift/HOST keeps a host's last round; GET lists every host's; a name that
    is not a host name is 422; without the admin token, 401."""
    admin = live_control_plane.admin
    assert admin.get("/api/v1/drift").json() == []
    failing = [{"promise": "mirror/service", "since": 100.0, "message": "stopped"}]
    assert admin.put("/api/v1/drift/b", json={"checked": 1.0, "promises": 3}).status_code == 200
    r = admin.put("/api/v1/drift/a", json={"checked": 1.0, "promises": 3, "failing": failing})
    assert r.status_code == 200, r.text
    admin.put("/api/v1/drift/a", json={"checked": 2.0, "promises": 3, "failing": failing})
    listed = admin.get("/api/v1/drift").json()
    assert [(d["host"], d["checked"], d["failing"]) for d in listed] == [
        ("a", 2.0, failing), ("b", 1.0, [])]
    bad = admin.put("/api/v1/drift/..%20x", json={"checked": 1.0, "promises": 0})
    assert bad.status_code in (404, 422)
    anonymous = live_control_plane.anonymous().put("/api/v1/drift/a",
                                                   json={"checked": 3.0, "promises": 0})
    assert anonymous.status_code == 401


def test_a_refused_body_is_one_line_in_the_words_every_boundary_uses(live_control_plane) -> None:
    """`llmgw models add` prints the detail as it comes: one sentence, not pydantic's list."""
    r = live_control_plane.admin.post("/api/v1/models", json=_with(sha256="abc"))
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert isinstance(detail, str) and detail.startswith("POST /api/v1/models refused: "), r.text
    assert "sha256 is 'abc': sha256 must be 64 lower-case hex digits" in detail, detail


def test_a_replica_on_cpu_on_a_gpu_node_says_why_it_is_not_on_the_gpu(live_control_plane):
    """GET /api/v1/replicas: held_back names the card and its free memory against what
    the model needs; `llmgw status` shows it as a `!!` line. The control: a card with room
    (the move is due) has nothing to explain, and neither has a node without GPUs."""
    from llmgw.cli.commands.status import render

    cp = live_control_plane
    gib = 1 << 30
    model = _with(size_bytes=4 * gib, profiles=[
        {"name": "gpu", "engine": "llamacpp", "gpu_class": "h100-80gb", "priority": 200},
        {"name": "cpu", "engine": "llamacpp", "priority": 100}])
    model["geometry"] = {"block_count": 28, "context_length": 32768, "head_count": 28,
                         "head_count_kv": 4, "embedding_length": 3584}
    assert cp.admin.post("/api/v1/models", json=model).status_code == 201, "added"
    card = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "class": "h100-80gb", "uuid": "GPU-a",
            "memory_mb": 81_559, "memory_free_mb": 2_048, "memory_used_mb": 79_511, "error": ""}

    def beat(free_mb: int, gpus: bool = True) -> dict:
        cp.store.record_heartbeat("n", {"engines": ["llamacpp", "llamacpp-cuda"],
                                        "gpus": [{**card, "memory_free_mb": free_mb}] if gpus
                                        else []})
        (shown,) = cp.admin.get("/api/v1/replicas").json()
        return shown

    cp.store.put_replica({"id": "r1", "model": "tiny", "node": "n", "profile": "cpu",
                          "state": "ready"})
    shown = beat(2_048)
    assert shown["held_back"].startswith(
        "gpu: node n's GPU GPU-a has 2.0 GiB free, 77.6 GiB used by other processes; tiny "
        "needs 5.6 GiB: 4.0 GiB weights + "), shown
    lines = render([], [shown], 0.0).splitlines()
    assert any(line.startswith("!! tiny runs on cpu on n (replica r1), not a better profile: "
                               "gpu: node n's GPU GPU-a has 2.0 GiB free") for line in lines)
    assert beat(40_000)["held_back"] == ""
    assert beat(2_048, gpus=False)["held_back"] == ""


def test_status_shows_each_cards_free_memory_or_that_it_stopped_answering() -> None:
    from llmgw.cli.commands.status import render

    card = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_mb": 81_559, "uuid": "GPU-a"}
    node = {"id": "n", "state": "ready", "engines": ["llamacpp"], "last_seen": 0.0,
            "gpus": [{**card, "memory_free_mb": 1_536, "memory_used_mb": 80_023, "error": ""},
                     {**card, "uuid": "GPU-b", "error": "GPU is lost"}]}
    shown = render([node], [], 0.0)  # type: ignore[list-item]
    assert "NVIDIA H100 80GB HBM3 79 GB (1.5 GB free)" in shown
    assert "NVIDIA H100 80GB HBM3 79 GB (not answering NVML)" in shown
    # Negative control: an older agent's card (no live figures) shows as before.
    older = render([{**node, "gpus": [card]}], [], 0.0)  # type: ignore[list-item]
    assert "NVIDIA H100 80GB HBM3 79 GB" in older and "free" not in older


def test_a_split_replica_is_shown_with_its_workers_and_never_its_key() -> None:
    """GET /api/v1/replicas's record of a split replica: its main node and its workers with
    their layers and last reports. The control: a replica on one node has no workers."""
    from llmgw.control.admin_api import public_replica

    workers = [{"node": "b", "layers": 12, "addr": "10.0.0.2", "port": 7001, "state": "ready",
                "err": ""}]
    split = {"id": "r1", "model": "big", "node": "a", "profile": "cpu", "state": "ready",
             "api_key": "secret", "gpus": [], "workers": workers}
    shown = public_replica(split)  # type: ignore[arg-type]
    assert (shown["node"], shown["workers"]) == ("a", workers) and "api_key" not in shown
    alone = public_replica({**split, "workers": []})  # type: ignore[typeddict-item]
    assert "workers" not in alone


def test_the_admin_api_shows_a_nodes_rpc_backend_and_a_split_replicas_workers(
        live_control_plane) -> None:
    """GET /api/v1/nodes says which nodes have llama.cpp's RPC backend; GET
    /api/v1/replicas lists a split replica's workers. The controls: a node without it
    says false, a replica on one node lists none."""
    cp = live_control_plane
    cp.store.record_heartbeat("a", {"engines": ["llamacpp"], "rpc": True})
    cp.store.record_heartbeat("b", {"engines": ["llamacpp"]})
    workers = [{"node": "b", "layers": 12, "addr": "10.0.0.2", "port": 7001}]
    cp.store.put_replica({"id": "r1", "model": "big", "node": "a", "profile": "cpu",
                          "state": "ready", "workers": workers})
    cp.store.put_replica({"id": "r2", "model": "big", "node": "a", "profile": "cpu",
                          "state": "ready"})
    nodes = {n["id"]: n for n in cp.admin.get("/api/v1/nodes").json()}
    assert (nodes["a"]["rpc"], nodes["b"]["rpc"]) == (True, False)
    replicas = {r["id"]: r for r in cp.admin.get("/api/v1/replicas").json()}
    assert replicas["r1"]["workers"] == workers and "workers" not in replicas["r2"]
