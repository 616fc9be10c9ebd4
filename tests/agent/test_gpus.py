"""GPU discovery: the class rule over real device names, NVML absent, cards NVML cannot see."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from llmgw.agent import gpus

NAMES = [
    ("NVIDIA H200", 143771, "h200"),
    ("NVIDIA H100 80GB HBM3", 81559, "h100-80gb"),
    ("NVIDIA H100 PCIe", 81559, "h100-80gb"),
    ("NVIDIA H100 NVL", 95830, "h100-94gb"),
    ("NVIDIA A100-SXM4-80GB", 81920, "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", 40960, "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", 40536, "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", 81920, "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", 4864, "a100-40gb"),
    ("Tesla V100-SXM2-16GB", 16160, "v100-16gb"),
    ("Tesla V100-PCIE-32GB", 32510, "v100-32gb"),
    ("Tesla T4", 15360, "t4"),
    ("NVIDIA L4", 23034, "l4"),
    ("NVIDIA L40S", 46068, "l40s"),
    ("NVIDIA A10G", 23028, "a10g"),
    ("NVIDIA GeForce RTX 4090", 24564, "rtx-4090"),
    ("NVIDIA GeForce RTX 3090 Ti", 24564, "rtx-3090-ti"),
    ("NVIDIA RTX A6000", 49140, "rtx-a6000"),
    ("NVIDIA RTX 6000 Ada Generation", 49140, "rtx-6000-ada"),
    ("Quadro RTX 8000", 49152, "rtx-8000"),
    ("NVIDIA B200", 183359, "b200"),
    ("NVIDIA GH200 480GB", 97871, "gh200"),
]


@pytest.mark.parametrize(("name", "memory_mb", "expected"), NAMES)
def test_gpu_class_of_real_device_names(name: str, memory_mb: int, expected: str) -> None:
    assert gpus.gpu_class(name, memory_mb) == expected


def test_multi_size_chip_without_memory_is_named_by_chip_only() -> None:
    """A100 with neither a size in its name nor a memory reading: the chip, not a guess."""
    assert gpus.gpu_class("NVIDIA A100 PCIe", 0) == "a100"


def _device(root: Path, addr: str, vendor: str, klass: str) -> None:
    d = root / addr
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "class").write_text(klass + "\n")


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """A fake /sys/bus/pci/devices with a host bridge and a network card."""
    _device(tmp_path, "0000:00:00.0", "0x8086", "0x060000")
    _device(tmp_path, "0000:00:03.0", "0x1af4", "0x020000")
    return tmp_path


def test_cards_on_bus_finds_nvidia_display_controllers_only(sysfs: Path) -> None:
    _device(sysfs, "0000:41:00.0", "0x10de", "0x030200")  # 3D controller (datacenter)
    _device(sysfs, "0000:42:00.0", "0x10de", "0x030000")  # VGA (workstation)
    _device(sysfs, "0000:41:00.1", "0x10de", "0x040300")  # its HDMI audio: no GPU
    _device(sysfs, "0000:43:00.0", "0x10de", "0x068000")  # NVSwitch bridge: no GPU
    assert gpus.nvidia_cards_on_bus(sysfs) == ["0000:41:00.0", "0000:42:00.0"]


def test_card_nvml_cannot_see_is_a_warning_and_a_cpu_node(sysfs: Path) -> None:
    _device(sysfs, "0000:41:00.0", "0x10de", "0x030200")
    found = gpus.discover(nvml=_AbsentNVML(), pci_root=sysfs)
    assert found.gpus == []
    assert len(found.warnings) == 1
    warning = found.warnings[0]
    assert "0000:41:00.0" in warning and "install the NVIDIA driver" in warning
    assert "serves on CPU" in warning


def test_no_card_and_no_nvml_is_a_quiet_cpu_node(sysfs: Path) -> None:
    found = gpus.discover(nvml=_AbsentNVML(), pci_root=sysfs)
    assert found == gpus.Discovery([], [])


def test_this_machine_without_nvml_library_is_a_cpu_node() -> None:
    """The real pynvml here finds no libnvidia-ml: an answer (no GPUs), not an error."""
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        assert gpus.nvml_gpus() == []
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML works on this machine")


def test_pynvml_not_installed_is_a_cpu_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus, "_load_nvml", lambda: None)
    assert gpus.nvml_gpus() == []


def test_nvml_devices_become_gpus_with_their_class(sysfs: Path) -> None:
    nvml = _FakeNVML([("NVIDIA A100-SXM4-80GB", 85899345920), ("NVIDIA L4", 24152899584)])
    found = gpus.discover(nvml=nvml, pci_root=sysfs)
    assert [g.as_dict() for g in found.gpus] == [
        {"index": 0, "name": "NVIDIA A100-SXM4-80GB", "memory_mb": 81920, "uuid": "GPU-0",
         "class": "a100-80gb"},
        {"index": 1, "name": "NVIDIA L4", "memory_mb": 23034, "uuid": "GPU-1", "class": "l4"},
    ]
    assert found.classes() == ["a100-80gb", "l4"] and found.warnings == []
    assert nvml.shut_down


class _NVMLError(Exception):
    pass


class _AbsentNVML:
    """pynvml when libnvidia-ml.so is not there: nvmlInit raises."""

    NVMLError = _NVMLError

    def nvmlInit(self) -> None:
        raise _NVMLError("NVML Shared Library Not Found")


class _FakeNVML:
    NVMLError = _NVMLError

    def __init__(self, devices: list[tuple[str, int]]) -> None:
        self.devices = devices
        self.shut_down = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, i: int) -> bytes:
        return self.devices[i][0].encode()  # older pynvml answers bytes

    def nvmlDeviceGetMemoryInfo(self, i: int) -> SimpleNamespace:
        return SimpleNamespace(total=self.devices[i][1])

    def nvmlDeviceGetUUID(self, i: int) -> str:
        return f"GPU-{i}"
