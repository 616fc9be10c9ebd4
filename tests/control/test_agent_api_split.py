"""The agent API's answer for a replica split over nodes (the real store, the agent API's
heartbeat as the TLS server calls it): each worker gets its share (its layers, its main
node, rpc-server's threads alone); the main node gets the replica, with every worker's
relay, only once each has reported its port; a worker's report carries its relay port."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmgw.contract.catalog import CATALOG_MODEL
from llmgw.contract.records import RecordError
from llmgw.control.agent_api import AgentAPI
from llmgw.control.scheduler import Scheduler
from llmgw.store import Store

SPEC = {"name": "big", "source": "http://mirror/big.gguf", "sha256": "",
        "profiles": [{"name": "cpu", "engine": "llamacpp", "gpu_class": "",
                      "args": ["--threads", "6", "--ctx-size", "4096"], "nodes": "auto"}]}
GEOMETRY = {"block_count": 40, "context_length": 8192, "head_count": 32, "head_count_kv": 8,
            "embedding_length": 4096, "feed_forward_length": 14336}
SPLIT: dict[str, Any] = {
    "id": "r1", "model": "big", "node": "a", "profile": "cpu", "state": "pending",
    "gpus": [], "workers": [{"node": "b", "layers": 12, "addr": "", "port": 0},
                            {"node": "c", "layers": 8, "addr": "", "port": 0}]}


@pytest.fixture
def api(tmp_path: Path) -> Any:
    store = Store(tmp_path / "control.db")
    store.add_model(SPEC)  # type: ignore[arg-type]
    store.put_replica(SPLIT)  # type: ignore[arg-type]
    yield AgentAPI(store)
    store.close()


def _beat(api: AgentAPI, node: str, *reports: dict[str, Any]) -> list[dict[str, Any]]:
    body = {"engines": ["llamacpp"], "rpc": True, "addr": f"10.0.0.{ord(node) - 96}",
            "replicas": list(reports)}
    return list(api.heartbeat(node, body)["replicas"])  # type: ignore[arg-type]


def _relay(port: int) -> dict[str, Any]:
    return {"id": "r1", "state": "ready", "relay_port": port}


def test_each_worker_gets_its_share_with_rpc_servers_threads_alone(api: AgentAPI) -> None:
    """b's answer: r1 as a worker of main a with 12 layers, its args the profile's
    --threads alone, no GPUs. The control: a node that is no part of it gets nothing."""
    (share,) = _beat(api, "b")
    assert share["split"] == {"role": "worker", "main": "a", "layers": 12}
    assert (share["id"], share["args"], share["gpus"]) == ("r1", ["--threads", "6"], [])
    assert _beat(api, "c")[0]["split"]["layers"] == 8
    assert _beat(api, "d") == []


def test_the_main_node_gets_the_replica_only_once_every_worker_has_its_relay_port(
        api: AgentAPI) -> None:
    """a gets nothing while b's and then c's relay ports are unknown; once both reported,
    it gets r1 with both workers (addresses from their inventories, ports from their
    reports) and the full engine args. The control: a's answer with one port missing."""
    assert _beat(api, "a") == []
    _beat(api, "b", _relay(7001))
    assert _beat(api, "a") == [], "c has not reported its relay yet"
    _beat(api, "c", {"id": "r1", "state": "starting"})
    assert _beat(api, "a") == [], "c is starting, with no relay port yet"
    _beat(api, "c", _relay(7002))
    (main,) = _beat(api, "a")
    assert main["split"] == {"role": "main", "workers": [
        {"node": "b", "layers": 12, "addr": "10.0.0.2", "port": 7001, "state": "ready",
         "err": ""},
        {"node": "c", "layers": 8, "addr": "10.0.0.3", "port": 7002, "state": "ready",
         "err": ""}]}
    assert main["args"][:4] == ["--threads", "6", "--ctx-size", "4096"]
    (replica,) = api.store.replicas()
    assert replica["state"] == "pending", "a worker's report is never the replica's state"


def test_a_relay_port_of_the_wrong_type_is_refused_naming_it(api: AgentAPI) -> None:
    """relay_port must be a number: the beat is refused whole. The control: a number
    passes."""
    with pytest.raises(RecordError, match="relay_port"):
        _beat(api, "b", _relay("seven"))  # type: ignore[arg-type]
    assert _beat(api, "b", _relay(7001))[0]["split"]["role"] == "worker"


def test_a_worker_of_a_stopped_replica_gets_nothing_of_it(api: AgentAPI) -> None:
    """Once the scheduler stopped r1 (its worker c was lost), c back gets nothing of it:
    a new replica is placed anew. The control: before, c had its share."""
    assert _beat(api, "c")[0]["id"] == "r1"
    api.store.update_replica("r1", state="stopped", err="its worker c is not ready")
    assert _beat(api, "c", _relay(7002)) == []
    assert _beat(api, "b", _relay(7001)) == []


def test_a_worker_without_a_management_address_keeps_the_main_waiting(api: AgentAPI) -> None:
    """A worker whose heartbeat names no address cannot be reached, whatever its port: the
    main node gets nothing. The control: once its beat names one, the main gets r1."""
    _beat(api, "b", _relay(7001))
    api.heartbeat("c", {"engines": ["llamacpp"], "rpc": True, "replicas": [_relay(7002)]})
    assert _beat(api, "a") == []
    _beat(api, "c", _relay(7002))
    assert [w["addr"] for w in _beat(api, "a")[0]["split"]["workers"]] == ["10.0.0.2",
                                                                         "10.0.0.3"]


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_scheduler_splits_fails_and_places_again_through_the_store(tmp_path: Path) -> None:
    """End to end over one store: nodes a, b, c (16 GiB, the RPC backend) beat; the
    scheduler splits big over a + b; b's share and relay port reach a's answer. b goes
    silent past the node timeout: the replica is stopped saying so and a new one placed
    over a + c; b, back, gets nothing of the old one. The control: before the timeout the
    tick changes nothing."""
    clock = Clock()
    store = Store(tmp_path / "control.db", clock=clock)
    store.add_model(CATALOG_MODEL.validate_python({**SPEC, "size_bytes": 20 * 1024**3,
                                                   "geometry": GEOMETRY}))
    api, scheduler = AgentAPI(store, node_timeout_s=30), Scheduler(store, 30)

    def beat(node: str, *reports: dict[str, Any]) -> list[dict[str, Any]]:
        body = {"engines": ["llamacpp"], "rpc": True, "memory_mb": 16_384,
                "addr": f"10.0.0.{ord(node) - 96}", "replicas": list(reports)}
        return list(api.heartbeat(node, body)["replicas"])  # type: ignore[arg-type]

    for n in "abc":
        beat(n)
    (first,) = scheduler.tick().add
    assert (first["node"], [w["node"] for w in first["workers"]]) == ("a", ["b"])
    rid = first["id"]
    (share,) = beat("b", {"id": rid, "state": "ready", "relay_port": 7001})
    assert share["split"]["role"] == "worker"
    (main,) = beat("a")
    assert main["split"]["workers"][0]["port"] == 7001
    clock.now += 20
    for n in "ac":
        beat(n)
    calm = scheduler.tick()
    assert not (calm.stop or calm.add)
    clock.now += 20  # b silent for 40 s
    for n in "ac":
        beat(n)
    p = scheduler.tick()
    assert p.stop == {rid: "its worker b is not ready: llama.cpp's RPC has no failover, so "
                           "the replica is stopped and placed again where it now fits"}
    (again,) = p.add
    assert again["id"] != rid and [w["node"] for w in again["workers"]] == ["c"]
    assert beat("b", {"id": rid, "state": "ready", "relay_port": 7001}) == []
    assert [r["id"] for r in beat("c")] == [again["id"]]
    store.close()


GPU_SPEC = {**SPEC, "name": "big-gpu", "geometry": GEOMETRY, "size_bytes": 70 * 10**9,
            "profiles": [{"name": "gpu", "engine": "llamacpp", "gpu_class": "rtx-4090",
                          "args": ["--threads", "6", "--ctx-size", "4096"], "nodes": "auto",
                          "gpus": 2}]}
GPU_SPLIT: dict[str, Any] = {
    "id": "r2", "model": "big-gpu", "node": "a", "profile": "gpu", "state": "pending",
    "gpus": ["GPU-a-0", "GPU-a-1"],
    "workers": [{"node": "b", "layers": 20, "addr": "", "port": 0,
                 "gpus": ["GPU-b-0", "GPU-b-1"]},
                {"node": "c", "layers": 4, "addr": "", "port": 0}]}


def test_a_gpu_split_gives_each_worker_its_cards_and_the_cuda_engine(tmp_path: Path) -> None:
    """A GPU profile split over a, b and c: b's share carries b's two cards and the CUDA
    engine (its rpc-server is the CUDA build's); once both relays are known a's answer
    carries a's cards and the 16 layers they keep (40 less the workers' 24). The
    control: c's entry names no cards, and c gets none (a worker is never handed the
    main's cards); a CPU split's main answer has no layers (test above)."""
    store = Store(tmp_path / "control.db")
    store.add_model(CATALOG_MODEL.validate_python(GPU_SPEC))
    store.put_replica(GPU_SPLIT)  # type: ignore[arg-type]
    api = AgentAPI(store)
    (share,) = _beat(api, "b", {"id": "r2", "state": "ready", "relay_port": 7001})
    assert (share["engine"], share["gpus"], share["args"]) == (
        "llamacpp-cuda", ["GPU-b-0", "GPU-b-1"], ["--threads", "6"])
    assert share["split"] == {"role": "worker", "main": "a", "layers": 20}
    (other,) = _beat(api, "c", {"id": "r2", "state": "ready", "relay_port": 7002})
    assert other["gpus"] == []
    (main,) = _beat(api, "a")
    assert (main["engine"], main["gpus"], main["split"]["layers"]) == (
        "llamacpp-cuda", ["GPU-a-0", "GPU-a-1"], 16)
    assert main["split"]["workers"][0]["gpus"] == ["GPU-b-0", "GPU-b-1"]
    store.close()


def test_the_scheduler_places_a_gpu_split_and_the_store_keeps_each_workers_cards(
        tmp_path: Path) -> None:
    """Nodes a and b beat with two 24 GB cards each, the CUDA engine and the RPC backend;
    a tick splits the 70 GB model over them, the store keeps b's cards in its entry, and
    b's answer carries them. The control: a third node c whose two cards are 48 GB takes
    it alone, with no workers."""
    def cards(node: str, mb: int) -> list[dict[str, Any]]:
        return [{"index": i, "class": "rtx-4090", "memory_mb": mb, "memory_free_mb": mb - 512,
                 "uuid": f"GPU-{node}-{i}", "name": "NVIDIA GeForce RTX 4090"}
                for i in range(2)]

    def placed(nodes: dict[str, int]) -> tuple[Store, AgentAPI, dict[str, Any]]:
        store = Store(tmp_path / f"control-{len(nodes)}.db")
        store.add_model(CATALOG_MODEL.validate_python(GPU_SPEC))
        api = AgentAPI(store)
        for n, mb in nodes.items():
            body = {"engines": ["llamacpp", "llamacpp-cuda"], "rpc": True,
                    "rpc_engines": ["llamacpp", "llamacpp-cuda"],
                    "memory_mb": 64_000, "addr": f"10.0.0.{ord(n) - 96}",
                    "gpus": cards(n, mb), "replicas": []}
            api.heartbeat(n, body)  # type: ignore[arg-type]
        Scheduler(store, 30).tick()
        (replica,) = store.replicas()
        return store, api, dict(replica)

    store, api, r = placed({"a": 24_576, "b": 24_576})
    assert (r["node"], r["gpus"]) == ("a", ["GPU-a-0", "GPU-a-1"])
    assert [(w["node"], w["gpus"]) for w in r["workers"]] == [("b", ["GPU-b-0", "GPU-b-1"])]
    (share,) = _beat(api, "b")
    assert (share["engine"], share["gpus"]) == ("llamacpp-cuda", ["GPU-b-0", "GPU-b-1"])
    store.close()
    store, _, r = placed({"a": 24_576, "b": 24_576, "c": 49_152})
    assert (r["node"], r["gpus"], r.get("workers") or []) == ("c", ["GPU-c-0", "GPU-c-1"], [])
    store.close()
