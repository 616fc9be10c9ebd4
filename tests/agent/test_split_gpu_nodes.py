"""A GPU replica split over two nodes, each part run by its own ReplicaSupervisor as its
agent would, given the assignments the control plane sends for a GPU profile: the worker
runs the CUDA build's rpc-server on its cards, the main the CUDA llama-server on its own
cards with --rpc. The cards are the stand-in NVML's (tests/standin_nvml: four 24 GB cards,
the worker given 0 and 1, the main 2 and 3); the CUDA binaries are stand-ins that log
their command line and CUDA_VISIBLE_DEVICES and then run the real CPU build's
(tests/standin_cuda_server.py), so the relays between them are the real ones. What a real
card does with these flags is `scripts/gpu-check --fleet`'s RPC case."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.gpus import discover
from llmgw.agent.replicas.process import stop_engines
from llmgw.agent.replicas.split import WorkerShare
from llmgw.agent.replicas.supervisor import ReplicaSupervisor
from llmgw.contract import CPU_ENGINE, CUDA_ENGINE
from llmgw.contract.records import Gpu
from tests.agent.cluster_pki import Cluster
from tests.agent.gpu_node import standin_nvml
from tests.agent.test_split_replicas import WORKER_ADDR, chat, plain, report, served, until
from tests.standin_cuda_server import standin_cuda_server, standin_rpc_server

pytestmark = pytest.mark.slow

FOUR_24GB = ";".join(["NVIDIA GeForce RTX 4090:24564:8.9"] * 4)
CLASS = "rtx-4090"


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() \
        else []


class GpuNodes:
    """Supervisors standing for GPU nodes' agents, all seeing the stand-in NVML's four
    cards: the CUDA engine and its rpc-server are the logging stand-ins, the CPU engine and
    its rpc-server the real CPU build's."""

    def __init__(self, root: Path, cluster: Cluster, engine: tuple[str, str],
                 cards: list[Gpu]) -> None:
        self.root, self.cluster, self.cards = root, cluster, cards
        cuda, self.starts = standin_cuda_server(root / "cuda", real=engine[0])
        rpc, self.rpc_starts = standin_rpc_server(root / "cuda", real=engine[1])
        self.engines = {CPU_ENGINE: (engine[0], engine[1]), CUDA_ENGINE: (str(cuda), str(rpc))}
        self.made: list[ReplicaSupervisor] = []

    def make(self, name: str) -> ReplicaSupervisor:
        state = self.root / f"{name}-{len(self.made)}"
        sup = ReplicaSupervisor(
            state_dir=state, weights_dir=state / "weights",
            engine=lambda kind: self.engines[kind][0],
            rpc_server=lambda kind: self.engines[kind][1],
            tls=self.cluster.files[name], gpus=self.cards,
            bind_host=WORKER_ADDR if name.startswith("worker") else "127.0.0.1",
            interface="lo")
        self.made.append(sup)
        return sup

    def uuids(self, *indexes: int) -> list[str]:
        return [str(self.cards[i]["uuid"]) for i in indexes]

    def close(self) -> None:
        for sup in reversed(self.made):
            sup.reconcile([])
            for t in list(sup.retiring.values()):
                t.join(30)
            stop_engines(sup.dir.parent)


@pytest.fixture
def gpu_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cluster: Cluster,
              rpc_engine: tuple[str, str]) -> Iterator[GpuNodes]:
    """Function: a factory of GPU node supervisors (GpuNodes); all stopped afterwards."""
    cards = [g.as_dict() for g in discover(standin_nvml(monkeypatch, FOUR_24GB)).gpus]
    assert [c.get("class") for c in cards] == [CLASS] * 4, cards
    made = GpuNodes(tmp_path, cluster, rpc_engine, cards)
    yield made
    made.close()


def gpu_part(rid: str, source: tuple[str, str], gpus: list[str],
             split: dict[str, Any]) -> dict[str, Any]:
    """An assignment of the tiny model on the GPU profile, as the agent API sends it."""
    return {**plain(rid, source), "profile": "gpu", "engine": CUDA_ENGINE, "gpu_class": CLASS,
            "gpus": gpus, "split": split}


def ready_gpu_worker(nodes: GpuNodes, rid: str, source: tuple[str, str],
                     gpus: list[str]) -> tuple[ReplicaSupervisor, int]:
    worker = nodes.make("worker-1")
    worker.reconcile([gpu_part(rid, source, gpus, {"role": "worker", "main": "main-1",
                                                   "layers": 1})])
    until(f"worker-1's part of {rid} to be ready",
          lambda: report(worker, rid)["state"] == "ready", last=lambda: report(worker, rid))
    return worker, int(report(worker, rid)["relay_port"])


def test_a_gpu_worker_runs_the_cuda_rpc_server_on_its_cards_alone(
        gpu_nodes: GpuNodes, served_gguf: tuple[str, str]) -> None:
    """worker-1 given cards 0 and 1: the CUDA build's rpc-server starts once, on
    127.0.0.1, with CUDA_VISIBLE_DEVICES their UUIDs in order and --device CUDA0,CUDA1 (so
    a CUDA that does not come up fails it rather than serving the CPU), and the part is
    ready with its relay; a share on a card whose assignment names the CPU engine runs the
    CUDA rpc-server too (never the CPU one on a card). The controls: a card this node's
    NVML does not have fails the part naming it, with no rpc-server started; a CPU share
    (no cards) runs the CPU build's rpc-server, never the CUDA one."""
    _, port = ready_gpu_worker(gpu_nodes, "r-gpu", served_gguf, gpu_nodes.uuids(0, 1))
    (start,) = jsonl(gpu_nodes.rpc_starts)
    assert start["cuda"] == ",".join(gpu_nodes.uuids(0, 1))
    argv = start["argv"]
    assert argv[argv.index("--device") + 1] == "CUDA0,CUDA1", argv
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and port > 0

    stranger = gpu_nodes.make("worker-1")
    stranger.reconcile([gpu_part("r-stranger", served_gguf, ["GPU-not-here"],
                                 {"role": "worker", "main": "main-1", "layers": 1})])
    until("the part on a card it lacks to fail",
          lambda: report(stranger, "r-stranger")["state"] == "failed",
          last=lambda: report(stranger, "r-stranger"))
    assert "GPU-not-here, which this node does not have" in report(stranger, "r-stranger")["err"]
    named_cpu = gpu_nodes.make("worker-1")
    named_cpu.reconcile([{**gpu_part("r-named-cpu", served_gguf, gpu_nodes.uuids(2),
                                     {"role": "worker", "main": "main-1", "layers": 1}),
                          "engine": CPU_ENGINE}])
    until("the part on card 2 to be ready",
          lambda: report(named_cpu, "r-named-cpu")["state"] == "ready",
          last=lambda: report(named_cpu, "r-named-cpu"))
    assert jsonl(gpu_nodes.rpc_starts)[1]["cuda"] == gpu_nodes.uuids(2)[0]
    cpu = gpu_nodes.make("worker-1")
    cpu.reconcile([{**plain("r-cpu", served_gguf),
                    "split": {"role": "worker", "main": "main-1", "layers": 1}}])
    until("the CPU part to be ready", lambda: report(cpu, "r-cpu")["state"] == "ready",
          last=lambda: report(cpu, "r-cpu"))
    assert len(jsonl(gpu_nodes.rpc_starts)) == 2, "the CPU share reached the CUDA rpc-server"


def _main_part(rid: str, source: tuple[str, str], gpus: list[str], port: int,
               worker_gpus: list[str], layers: int = 1) -> dict[str, Any]:
    return gpu_part(rid, source, gpus, {"role": "main", "layers": layers, "workers": [
        {"node": "worker-1", "layers": 1, "addr": WORKER_ADDR, "port": port,
         "gpus": worker_gpus}]})


def test_a_gpu_main_runs_the_cuda_engine_on_its_cards_with_rpc_and_a_split_per_device(
        gpu_nodes: GpuNodes, served_gguf: tuple[str, str]) -> None:
    """main-1 given cards 2 and 3 and worker-1 on cards 0 and 1 (one layer each side of
    the tiny model's two): the CUDA llama-server starts with CUDA_VISIBLE_DEVICES the main's
    UUIDs, --rpc to its relay, every layer offloaded, --split-mode layer and a
    --tensor-split of one count a device in llama.cpp's order (the worker's two, then the
    main's two: 1,0,1,0), no --device (it would leave the RPC devices out) and no
    --override-tensor (the output stays on the main's card, not its CPU); the CPU build
    the stand-in runs takes those flags, is ready and answers through the worker. The
    controls: the main on card 2 alone gives 1,0,1 (the split follows the devices); an
    assignment that does not say the main's layers fails saying the control plane is
    older, starting nothing."""
    worker, port = ready_gpu_worker(gpu_nodes, "r-main", served_gguf, gpu_nodes.uuids(0, 1))
    main = gpu_nodes.make("main-1")
    main.reconcile([_main_part("r-main", served_gguf, gpu_nodes.uuids(2, 3), port,
                               gpu_nodes.uuids(0, 1))])
    until("the GPU main's engine to start", lambda: len(jsonl(gpu_nodes.starts)) == 1,
          last=lambda: report(main, "r-main"))
    (start,) = jsonl(gpu_nodes.starts)
    argv = start["argv"]
    assert start["cuda"] == ",".join(gpu_nodes.uuids(2, 3))
    relay = main.replicas["r-main"].share
    assert relay is not None
    assert argv[argv.index("--rpc") + 1].startswith("127.0.0.1:"), argv
    assert argv[argv.index("--n-gpu-layers") + 1] == "999"
    assert argv[argv.index("--split-mode") + 1] == "layer"
    assert argv[argv.index("--tensor-split") + 1] == "1,0,1,0"
    assert "--device" not in argv and "--override-tensor" not in argv, argv
    # The stand-in runs the CPU build with these flags (less --n-gpu-layers): its parser
    # takes them, and the worker's relay carries weights to its rpc-server.
    r = served(main, "r-main")
    assert chat(r["endpoint"], r["api_key"])
    share = worker.replicas["r-main"].share
    assert isinstance(share, WorkerShare) and share.relay.counters.bytes_in > 0

    _, port = ready_gpu_worker(gpu_nodes, "r-one", served_gguf, gpu_nodes.uuids(0, 1))
    one = gpu_nodes.make("main-1")
    one.reconcile([_main_part("r-one", served_gguf, gpu_nodes.uuids(2), port,
                              gpu_nodes.uuids(0, 1))])
    until("the one-card main's engine to start", lambda: len(jsonl(gpu_nodes.starts)) == 2,
          last=lambda: report(one, "r-one"))
    argv = jsonl(gpu_nodes.starts)[1]["argv"]
    assert argv[argv.index("--tensor-split") + 1] == "1,0,1"

    _, port = ready_gpu_worker(gpu_nodes, "r-old", served_gguf, gpu_nodes.uuids(0, 1))
    old = gpu_nodes.make("main-1")
    part = _main_part("r-old", served_gguf, gpu_nodes.uuids(2, 3), port,
                      gpu_nodes.uuids(0, 1))
    del part["split"]["layers"]
    old.reconcile([part])
    until("the main without its layers to fail", lambda: report(old, "r-old")["state"]
          == "failed", last=lambda: report(old, "r-old"))
    assert "update the control plane" in report(old, "r-old")["err"]
    assert len(jsonl(gpu_nodes.starts)) == 2
