"""Each replica's command line and environment per profile: a GPU replica sees only the
GPUs the scheduler gave it (by UUID, in order) and offloads to them; a CPU replica sees
none and offloads nothing."""

from __future__ import annotations

import pytest

from llmgw.agent.engines.prebuilt_server import UsageError, parse
from llmgw.agent.replicas.process import placement
from llmgw.contract.records import Gpu

NODE: list[Gpu] = [{"index": 0, "uuid": "GPU-a", "class": "h100-80gb"},
                   {"index": 1, "uuid": "GPU-b", "class": "h100-80gb"},
                   {"index": 2, "uuid": "MIG-c", "class": "a100-1g.10gb", "mig_parent": "GPU-z"}]


def test_a_cpu_replica_sees_no_gpu_and_offloads_nothing() -> None:
    flags, env = placement([], NODE)
    assert flags == ["--device", "none", "--n-gpu-layers", "0"]
    assert env == {"CUDA_VISIBLE_DEVICES": ""}


def test_a_gpu_replica_sees_its_gpus_by_uuid_in_order_as_cuda0_on() -> None:
    flags, env = placement(["GPU-b", "GPU-a"], NODE)
    assert env == {"CUDA_VISIBLE_DEVICES": "GPU-b,GPU-a"}
    assert flags == ["--device", "CUDA0,CUDA1", "--n-gpu-layers", "999"]


def test_one_mig_instance_is_one_device_of_its_own() -> None:
    flags, env = placement(["MIG-c"], NODE)
    assert env == {"CUDA_VISIBLE_DEVICES": "MIG-c"} and flags[:2] == ["--device", "CUDA0"]


def test_the_profiles_own_layer_count_is_kept() -> None:
    flags, _ = placement(["GPU-a"], NODE, ["-ngl", "20"])
    assert "--n-gpu-layers" not in flags and flags == ["--device", "CUDA0"]


def test_a_gpu_this_node_does_not_have_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="GPU-q, which this node does not have.*GPU-a"):
        placement(["GPU-q"], NODE)


def test_negative_control_a_gpu_replica_on_a_node_reporting_no_gpus_is_refused() -> None:
    with pytest.raises(ValueError, match="its GPUs: none"):
        placement(["GPU-a"], [])


def test_the_prebuilt_cpu_engine_takes_device_none_and_refuses_any_other() -> None:
    assert parse(["--device", "none", "-c", "512"]) == [("n_ctx", 512)]
    with pytest.raises(UsageError, match="CPU only"):
        parse(["--device", "CUDA0"])
    with pytest.raises(UsageError, match="CPU only"):
        parse(["-dev", "Vulkan0"])


def test_a_replica_placed_on_gpus_runs_on_the_cuda_engine_and_one_without_on_its_own() -> None:
    from llmgw.agent.replicas.process import engine_for

    gpu = {"id": "r", "model": "m", "profile": "gpu-h100", "engine": "llamacpp",
           "gpu_class": "h100-80gb", "source": "", "sha256": "", "args": [], "gpus": ["GPU-a"]}
    assert engine_for(gpu) == "llamacpp-cuda"  # type: ignore[arg-type]
    assert engine_for({**gpu, "gpus": []}) == "llamacpp"  # type: ignore[arg-type]
