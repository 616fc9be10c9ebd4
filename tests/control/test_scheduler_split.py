"""One replica over several nodes (a profile's `nodes: N|auto`, llama.cpp's RPC backend):
the scheduler splits a model over ready nodes with the RPC backend only where no single
node holds it; the split replica holds its share of memory on every node it uses, so no
second replica goes there; a split replica whose main node or worker is lost, or whose
worker failed, is stopped and a new one placed where it now fits. Pure plan(), no
processes."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from llmgw.contract.catalog import CATALOG_MODEL
from llmgw.control._split import RESERVE_BYTES
from llmgw.control.scheduler import GIB, MIB, place, plan, split_need
from tests.control.test_scheduler import model, node

GEOMETRY = {"block_count": 40, "context_length": 8192, "head_count": 32, "head_count_kv": 8,
            "embedding_length": 4096, "feed_forward_length": 14336}


def big(nodes: int | str = "auto", size_gib: float = 20, name: str = "big") -> dict[str, Any]:
    """A CPU model of size_gib (about 20.7 GiB in all with its KV cache at 4,096 tokens)."""
    m = model(name)
    m["profiles"][0].update(nodes=nodes, min_memory_gb=0, args=["--ctx-size", "4096"])
    return {**m, "size_bytes": int(size_gib * GIB), "geometry": dict(GEOMETRY)}


def rpc(id: str, memory_gib: float = 16, state: str = "ready", able: bool = True) -> dict:
    """A ready CPU node of memory_gib whose engine has the RPC backend (unless able=False)."""
    return {**node(id, state=state, memory_mb=int(memory_gib * 1024)), "rpc": able,
            "rpc_engines": ["llamacpp"] if able else []}


def split(id: str = "r1", main: str = "a", workers: tuple[str, ...] = ("b",),
          state: str = "ready", **worker: Any) -> dict[str, Any]:
    """A live split replica of big, its layers shared evenly, each worker as reported."""
    each = 40 // (len(workers) + 1)
    return {"id": id, "model": "big", "node": main, "profile": "cpu", "state": state,
            "gpus": [], "workers": [{"node": w, "layers": each, "addr": f"10.0.0.{i}",
                                     "port": 7000 + i, "state": "ready", **worker}
                                    for i, w in enumerate(workers)]}


def test_a_model_no_node_holds_is_split_over_a_main_node_and_a_worker() -> None:
    """20.7 GiB over two 16 GiB nodes: one replica, main a, worker b with half the layers
    (each gives the same); on one node the reason would have been what it needs there.
    The control: with nodes: 1 (and min_memory_gb saying its size) nothing is placed."""
    p = plan([big()], [rpc("a"), rpc("b")], [])
    (r,) = p.add
    assert (r["node"], r["profile"], r["err"]) == ("a", "cpu", "")
    assert r["workers"] == [{"node": "b", "layers": 20, "addr": "", "port": 0}]
    alone = place(big(), [rpc("a")], [], {"big": big()})
    assert "a has 16.0 GiB of memory free and big needs 20.7 GiB on one node" in alone.why, \
        alone.why
    unsplit = big(nodes=1)
    unsplit["profiles"][0]["min_memory_gb"] = 21
    (r,) = plan([unsplit], [rpc("a"), rpc("b")], []).add
    assert r["node"] == "" and "split over nodes" not in r["err"], r["err"]


def test_one_node_when_one_holds_it() -> None:
    """A node of 32 GiB holds it alone: no split. The control: without it, a split."""
    (r,) = plan([big()], [rpc("a"), rpc("b"), rpc("c", memory_gib=32)], []).add
    assert (r["node"], r.get("workers")) == ("c", None)
    (r,) = plan([big()], [rpc("a"), rpc("b")], []).add
    assert r["node"] == "a" and r.get("workers")


def test_only_nodes_with_the_rpc_backend_take_part_and_the_reason_says_how_to_get_it() -> None:
    """Two 16 GiB nodes without llama.cpp's RPC backend: nothing placed, and the reason
    names the source build (engine.prebuilt: off). The control: with it, placed."""
    (r,) = plan([big()], [rpc("a", able=False), rpc("b", able=False)], []).add
    assert r["node"] == "" and "engine.prebuilt: off" in r["err"], r["err"]
    assert "split over nodes: cpu: no ready node's CPU engine (llamacpp) has llama.cpp's RPC " \
        "backend" in r["err"]
    (r,) = plan([big()], [rpc("a"), rpc("b", able=False), rpc("c")], []).add
    assert (r["node"], [w["node"] for w in r["workers"]]) == ("a", ["c"])


def test_too_little_memory_over_every_node_says_what_they_give() -> None:
    """Two 8 GiB nodes cannot hold 20.7 GiB: the reason says the need and what they give.
    The control: three 8 GiB nodes with nodes: auto do (7 GiB each after the reserve)."""
    (r,) = plan([big()], [rpc("a", 8), rpc("b", 8)], []).add
    assert r["node"] == "" and "it needs 20.7 GiB and they give 14.0 GiB" in r["err"], r["err"]
    (r,) = plan([big()], [rpc("a", 8), rpc("b", 8), rpc("c", 8)], []).add
    assert r["node"] == "a" and [w["node"] for w in r["workers"]] == ["b", "c"]


def test_a_split_replica_holds_its_share_on_every_node_it_uses() -> None:
    """The split replica takes about 10.4 GiB of each 16 GiB node: a model of min 8 GB
    fits neither its main node nor its worker, and goes to the third node. The control:
    without the split replica it goes to the first node."""
    small = model("small")
    small["profiles"][0]["min_memory_gb"] = 8
    models = [big(), small]
    nodes = [rpc("a"), rpc("b"), rpc("c")]
    by_name = {m["name"]: m for m in models}
    held = [split()]
    assert place(small, nodes, held, by_name).node == "c"
    where = place(small, nodes[1:2], held, by_name)
    assert where.node == "" and "b has under 8 GB of memory free" in where.why, where.why
    assert place(small, nodes, [], by_name).node == "a"
    # In a whole plan: the split first, then the small model beside it.
    p = plan(models, nodes, [])
    assert [(r["model"], r["node"]) for r in p.add] == [("big", "a"), ("small", "c")]


def test_a_second_split_is_not_placed_on_memory_the_first_holds() -> None:
    """Two replicas of big over four 16 GiB nodes: the second goes on the two nodes the
    first does not use. The control: three nodes of 13 GiB, where the first leaves 2.6 GiB
    on each of its two: the second waits, saying what they give (were the first's memory
    counted free, a, b and c would hold it)."""
    m = big()
    m["scaling"] = {"min": 2, "max": 2, "idle_s": 0}
    p = plan([m], [rpc("a"), rpc("b"), rpc("c"), rpc("d")], [])
    assert [(r["node"], [w["node"] for w in r["workers"]]) for r in p.add] == [
        ("a", ["b"]), ("c", ["d"])]
    p = plan([m], [rpc("a", 13), rpc("b", 13), rpc("c", 13)], [])
    assert [r["node"] for r in p.add] == ["a", ""]
    assert "they give 15.3 GiB (c 12.0 GiB, a 1.6 GiB, b 1.6 GiB" in p.add[1]["err"], \
        p.add[1]["err"]


@pytest.mark.parametrize("lost", ["a", "b"])
def test_a_split_replica_whose_node_is_lost_is_stopped_and_placed_again(lost: str) -> None:
    """Main node a or worker b not ready: the replica is stopped saying which, and a new
    one (a new id) placed over the nodes that are. The control: all ready, no change."""
    nodes = [rpc("a"), rpc("b"), rpc("c")]
    nodes[ord(lost) - ord("a")]["state"] = "not_ready"
    p = plan([big()], nodes, [split()])
    role = "main node" if lost == "a" else "worker"
    assert p.stop == {"r1": f"its {role} {lost} is not ready: llama.cpp's RPC has no "
                            "failover, so the replica is stopped and placed again where it "
                            "now fits"}
    (new,) = p.add
    assert new["id"] != "r1" and lost not in [new["node"], *(w["node"] for w in new["workers"])]
    calm = plan([big()], [rpc("a"), rpc("b"), rpc("c")], [split()])
    assert not (calm.stop or calm.add or calm.place)


def test_a_split_replica_whose_worker_failed_its_share_is_stopped_with_its_reason() -> None:
    """A worker that reports its share failed (rpc-server exited) fails the replica. The
    control: a worker still starting does not."""
    p = plan([big()], [rpc("a"), rpc("b"), rpc("c")],
             [split(state="starting", err="rpc-server exited with 1")
              | {"workers": [{"node": "b", "layers": 20, "addr": "", "port": 0,
                              "state": "failed", "err": "rpc-server exited with 1"}]}])
    assert p.stop["r1"].startswith("its worker b failed its share: rpc-server exited with 1")
    assert len(p.add) == 1 and p.add[0]["id"] != "r1"
    calm = plan([big()], [rpc("a"), rpc("b"), rpc("c")], [split(state="starting")])
    assert not (calm.stop or calm.add)


def test_a_worker_that_comes_back_never_rejoins_the_old_replica() -> None:
    """Worker b lost: r1 stopped, r2 placed over a and c. b back and ready: r2 stays as it
    is and r1 stays stopped (nothing of it is placed again). The control: r1 was live
    with b in it before."""
    nodes = [rpc("a"), rpc("b", state="not_ready"), rpc("c")]
    first = plan([big()], nodes, [split()])
    (r2,) = first.add
    assert "r1" in first.stop and "b" not in [w["node"] for w in r2["workers"]]
    stopped = {**split(), "state": "stopped", "err": first.stop["r1"]}
    back = plan([big()], [rpc("a"), rpc("b"), rpc("c")], [stopped, {**r2, "state": "ready"}])
    assert not (back.add or back.stop or back.place or back.split)


def test_the_catalog_takes_nodes_from_1_to_8_or_auto() -> None:
    """nodes: 1 to 8 or auto; 0, 9, a word refused saying why. The control: the default
    is 1."""
    def spec(**profile: Any) -> dict[str, Any]:
        return {"name": "m", "source": "https://mirror/m.gguf",
                "profiles": [{"name": "p", "engine": "llamacpp", **profile}]}

    assert CATALOG_MODEL.validate_python(spec())["profiles"][0]["nodes"] == 1
    for ok in (2, 8, "auto"):
        assert CATALOG_MODEL.validate_python(spec(nodes=ok))["profiles"][0]["nodes"] == ok
    for bad in (0, 9, "many", True):
        with pytest.raises(ValidationError, match="nodes must be a number of nodes from 1 "
                                                  "to 8"):
            CATALOG_MODEL.validate_python(spec(nodes=bad))
    # A GPU profile takes it too (tests/control/test_scheduler_split_gpu.py).
    assert CATALOG_MODEL.validate_python(spec(nodes=2, gpu_class="h100"))["profiles"][0][
        "nodes"] == 2


def test_the_need_is_the_weights_the_kv_cache_and_a_compute_buffer() -> None:
    """What a split must find over its nodes, checked against the sum it names: weights +
    KV cache (40 layers x 8 heads x 128 x 2 x f16 x 4,096 tokens = 640 MiB) + compute.
    The control: min_memory_gb above it wins."""
    m = big()
    need = split_need(m, m["profiles"][0])
    kv = 40 * 8 * 128 * 2 * 2 * 4096
    assert 20 * GIB + kv < need < 20 * GIB + kv + GIB, need / GIB
    m["profiles"][0]["min_memory_gb"] = 30
    assert split_need(m, m["profiles"][0]) == 30 * GIB
    assert RESERVE_BYTES == GIB and MIB == 1024**2


def test_a_split_replica_whose_main_engine_failed_is_stopped_at_once() -> None:
    """The main engine exits when a worker's connection drops (RPC has no failover) and its
    node reports the replica failed: it is stopped at the next tick, before the lost
    worker's node times out. The control: a replica on one node that failed is left to
    its agent, which starts it again."""
    p = plan([big()], [rpc("a"), rpc("b"), rpc("c")],
             [split(state="failed") | {"err": "llama-server exited with 1"}])
    assert p.stop["r1"].startswith("its main node a's engine failed: llama-server exited")
    one = {"id": "r0", "model": "big", "node": "c", "profile": "cpu", "state": "failed",
           "gpus": []}
    assert not plan([big()], [rpc("a"), rpc("b"), rpc("c", 32)], [one]).stop
