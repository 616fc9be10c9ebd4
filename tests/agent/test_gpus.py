"""GPU discovery: the class rule over real device names, NVML absent, cards NVML cannot see,
one device failing, calls missing, MIG instances (a stand-in pynvml: no GPU here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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
    nvml = FakeNVML([Card("NVIDIA A100-SXM4-80GB", 81920, cc=(8, 0)),
                     Card("NVIDIA L4", 23034, free_mb=20000, cc=(8, 9))])
    found = gpus.discover(nvml=nvml, pci_root=sysfs)
    assert [g.as_dict() for g in found.gpus] == [
        {"index": 0, "name": "NVIDIA A100-SXM4-80GB", "memory_mb": 81920, "uuid": "GPU-0",
         "class": "a100-80gb", "memory_free_mb": 81920, "compute_capability": "8.0",
         "mig_parent": "", "unknown": []},
        {"index": 1, "name": "NVIDIA L4", "memory_mb": 23034, "uuid": "GPU-1", "class": "l4",
         "memory_free_mb": 20000, "compute_capability": "8.9", "mig_parent": "",
         "unknown": []},
    ]
    assert found.classes() == ["a100-80gb", "l4"] and found.warnings == []
    assert (found.cuda_driver, found.driver_version) == ("12.4", "550.54.15")
    assert nvml.shut_down


def test_the_architectures_to_build_are_the_distinct_capabilities_newest_first() -> None:
    nvml = FakeNVML([Card("NVIDIA A100-SXM4-80GB", 81920, cc=(8, 0)),
                     Card("NVIDIA H100 80GB HBM3", 81559, cc=(9, 0)),
                     Card("NVIDIA A100-SXM4-80GB", 81920, cc=(8, 0)),
                     Card("NVIDIA RTX PRO 6000", 97887, cc=(12, 0))])
    assert gpus.discover(nvml=nvml).cuda_archs() == ["120", "90", "80"]


def test_nvml_cuda_version_numbers_read_as_versions() -> None:
    for number, version in ((12040, "12.4"), (13000, "13.0"), (12090, "12.9"), (11080, "11.8")):
        assert gpus.discover(nvml=FakeNVML([Card("NVIDIA L4", 23034)],
                                           cuda_driver=number)).cuda_driver == version


def _one_card_on_bus(sysfs: Path) -> Path:
    _device(sysfs, "0000:41:00.0", "0x10de", "0x030200")
    _device(sysfs, "0000:42:00.0", "0x10de", "0x030200")
    return sysfs


def test_one_device_failing_a_call_keeps_every_gpu_and_names_what_is_unknown(
        sysfs: Path) -> None:
    """One NVMLError on one device: that device's memory is unknown and named; the other
    GPU is whole; no "install the driver" warning (the driver is there)."""
    nvml = FakeNVML([Card("NVIDIA H100 80GB HBM3", 81559, fail={"nvmlDeviceGetMemoryInfo"}),
                     Card("NVIDIA H100 80GB HBM3", 81559)])
    found = gpus.discover(nvml=nvml, pci_root=_one_card_on_bus(sysfs))
    assert [g.uuid for g in found.gpus] == ["GPU-0", "GPU-1"]
    broken, whole = found.gpus
    assert (broken.memory_mb, broken.memory_free_mb) == (0, 0)
    assert broken.unknown == ("memory_mb", "memory_free_mb")
    assert broken.gpu_class == "h100-80gb", "its name still says its size"
    assert whole.memory_mb == 81559 and whole.unknown == ()
    assert len(found.warnings) == 1, found.warnings
    warning = found.warnings[0]
    assert "GPU 0 (NVIDIA H100 80GB HBM3, GPU-0)" in warning
    assert "memory (nvmlDeviceGetMemoryInfo: Unknown Error)" in warning
    assert "install" not in warning and "nvidia-smi -q -i 0" in warning


def test_the_same_devices_without_the_failure_warn_of_nothing(sysfs: Path) -> None:
    """Negative control of the one above."""
    nvml = FakeNVML([Card("NVIDIA H100 80GB HBM3", 81559), Card("NVIDIA H100 80GB HBM3", 81559)])
    found = gpus.discover(nvml=nvml, pci_root=_one_card_on_bus(sysfs))
    assert found.warnings == [] and all(g.unknown == () for g in found.gpus)


def test_a_device_nvml_cannot_open_is_left_out_and_named_the_others_kept(sysfs: Path) -> None:
    nvml = FakeNVML([Card("NVIDIA L4", 23034), Card("NVIDIA L4", 23034, unopenable=True),
                     Card("NVIDIA L4", 23034)])
    found = gpus.discover(nvml=nvml, pci_root=sysfs)
    assert [g.index for g in found.gpus] == [0, 2]
    assert len(found.warnings) == 1
    assert found.warnings[0].startswith("NVML cannot open GPU 1 (handle (")
    assert "nvidia-smi -i 1" in found.warnings[0]


def test_a_call_missing_from_nvidia_ml_py_makes_that_property_unknown(sysfs: Path) -> None:
    """An older nvidia-ml-py without nvmlDeviceGetCudaComputeCapability (AttributeError):
    every GPU kept, the property unknown, one warning for the machine."""
    nvml = FakeNVML([Card("NVIDIA T4", 15360), Card("NVIDIA L4", 23034)],
                    missing={"nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetMigMode"})
    found = gpus.discover(nvml=nvml, pci_root=sysfs)
    assert [g.compute_capability for g in found.gpus] == ["", ""]
    assert all(g.unknown == ("compute_capability",) for g in found.gpus)
    assert found.cuda_archs() == []
    assert found.warnings == [
        "the installed nvidia-ml-py lacks nvmlDeviceGetCudaComputeCapability, "
        "nvmlDeviceGetMigMode, so these are unknown on every GPU: compute capability, MIG "
        "mode; update it in llmgw's environment (`pip install -U nvidia-ml-py`) and "
        "restart the agent"]


def test_the_driver_cuda_version_unread_is_named_and_cuda_12_assumed() -> None:
    nvml = FakeNVML([Card("NVIDIA L4", 23034)], missing={"nvmlSystemGetCudaDriverVersion"})
    found = gpus.discover(nvml=nvml)
    assert found.cuda_driver == "" and len(found.gpus) == 1
    assert len(found.warnings) == 1
    assert "lacks nvmlSystemGetCudaDriverVersion, so these are unknown on every GPU: CUDA " \
        "version, and" in found.warnings[0]
    assert "the GPU engine is built for CUDA 12" in found.warnings[0]


def test_mig_instances_are_each_a_gpu_with_their_own_uuid_and_memory(sysfs: Path) -> None:
    """A GPU in MIG mode is its instances (slot 1 empty); a MIG-capable GPU with MIG off
    and a GPU without MIG are whole GPUs; none of it is a warning."""
    a100 = Card("NVIDIA A100-SXM4-40GB", 40960, cc=(8, 0), mig_on=True, instances=[
        Card("NVIDIA A100-SXM4-40GB MIG 3g.20gb", 19968),
        None,
        Card("NVIDIA A100-SXM4-40GB MIG 1g.5gb", 4864, free_mb=4000),
    ])
    nvml = FakeNVML([a100, Card("NVIDIA H100 80GB HBM3", 81559, cc=(9, 0), mig_on=False),
                     Card("NVIDIA GeForce RTX 4090", 24564, cc=(8, 9))])
    found = gpus.discover(nvml=nvml, pci_root=sysfs)
    assert found.warnings == []
    assert [(g.index, g.uuid, g.memory_mb, g.memory_free_mb, g.mig_parent, g.gpu_class,
             g.compute_capability) for g in found.gpus] == [
        (0, "MIG-0-0", 19968, 19968, "GPU-0", "a100-40gb", "8.0"),
        (0, "MIG-0-2", 4864, 4000, "GPU-0", "a100-40gb", "8.0"),
        (1, "GPU-1", 81559, 81559, "", "h100-80gb", "9.0"),
        (2, "GPU-2", 24564, 24564, "", "rtx-4090", "8.9"),
    ]
    assert found.gpus[1].name == "NVIDIA A100-SXM4-40GB MIG 1g.5gb"


def test_mig_mode_without_instances_is_a_warning_and_no_gpu() -> None:
    nvml = FakeNVML([Card("NVIDIA H100 80GB HBM3", 81559, mig_on=True, instances=[None, None])])
    found = gpus.discover(nvml=nvml)
    assert found.gpus == []
    assert len(found.warnings) == 1 and "MIG mode but has no MIG instances" in found.warnings[0]


def test_a_driver_that_cannot_count_its_gpus_is_named_not_told_to_install(sysfs: Path) -> None:
    nvml = FakeNVML([Card("NVIDIA L4", 23034)], fail_count=True)
    found = gpus.discover(nvml=nvml, pci_root=_one_card_on_bus(sysfs))
    assert found.gpus == []
    assert len(found.warnings) == 1
    assert found.warnings[0].startswith("the NVIDIA driver answers but cannot count its GPUs")
    assert "install the NVIDIA driver" not in found.warnings[0]


def test_nvml_failing_to_start_says_why_in_the_one_no_driver_warning(sysfs: Path) -> None:
    _device(sysfs, "0000:41:00.0", "0x10de", "0x030200")
    found = gpus.discover(nvml=_AbsentNVML("RM has detected an NVML/RM version mismatch."),
                          pci_root=sysfs)
    assert found.gpus == [] and len(found.warnings) == 1
    assert "(RM has detected an NVML/RM version mismatch.)" in found.warnings[0]
    assert "reboot" in found.warnings[0]


class _NVMLError(Exception):
    def __init__(self, value: int, text: str) -> None:
        super().__init__(text)
        self.value = value


_UNKNOWN, _NOT_SUPPORTED, _NOT_FOUND = 999, 3, 6


class _AbsentNVML:
    """pynvml when libnvidia-ml.so is not there (or does not work): nvmlInit raises."""

    NVMLError = _NVMLError

    def __init__(self, why: str = "NVML Shared Library Not Found") -> None:
        self.why = why

    def nvmlInit(self) -> None:
        raise _NVMLError(12, self.why)


@dataclass
class Card:
    """One device as the stand-in NVML reports it. mig_on None: MIG is not supported;
    instances: MIG slots (None an empty slot); fail: NVML calls that raise for it."""

    name: str
    memory_mb: int
    free_mb: int | None = None
    cc: tuple[int, int] = (9, 0)
    mig_on: bool | None = None
    instances: list[Card | None] = field(default_factory=list)
    fail: set[str] = field(default_factory=set)
    unopenable: bool = False


class FakeNVML:
    """A stand-in pynvml for the pure logic (no GPU here): handles are ("gpu", i) and
    ("mig", i, slot); `missing` names calls this nvidia-ml-py lacks (AttributeError)."""

    NVMLError = _NVMLError

    def __init__(self, cards: list[Card], *, cuda_driver: int = 12040,
                 missing: set[str] | frozenset[str] = frozenset(),
                 fail_count: bool = False) -> None:
        self.cards = cards
        self.cuda_driver = cuda_driver
        self.missing = missing
        self.fail_count = fail_count
        self.shut_down = False

    def __getattribute__(self, name: str) -> Any:
        if name in object.__getattribute__(self, "missing"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def _card(self, handle: tuple, call: str) -> Card:
        card = self.cards[handle[1]]
        if handle[0] == "mig":
            card = card.instances[handle[2]]  # type: ignore[assignment]
        if call in card.fail:
            raise _NVMLError(_UNKNOWN, "Unknown Error")
        return card

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda_driver

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        if self.fail_count:
            raise _NVMLError(_UNKNOWN, "Unknown Error")
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> tuple:
        if self.cards[i].unopenable:
            raise _NVMLError(15, "GPU is lost")
        return ("gpu", i)

    def nvmlDeviceGetName(self, h: tuple) -> bytes:
        return self._card(h, "nvmlDeviceGetName").name.encode()  # older pynvml answers bytes

    def nvmlDeviceGetMemoryInfo(self, h: tuple) -> SimpleNamespace:
        card = self._card(h, "nvmlDeviceGetMemoryInfo")
        free = card.memory_mb if card.free_mb is None else card.free_mb
        return SimpleNamespace(total=card.memory_mb * 2**20, free=free * 2**20, used=0)

    def nvmlDeviceGetUUID(self, h: tuple) -> str:
        self._card(h, "nvmlDeviceGetUUID")
        return f"GPU-{h[1]}" if h[0] == "gpu" else f"MIG-{h[1]}-{h[2]}"

    def nvmlDeviceGetCudaComputeCapability(self, h: tuple) -> tuple[int, int]:
        return self._card(h, "nvmlDeviceGetCudaComputeCapability").cc

    def nvmlDeviceGetMigMode(self, h: tuple) -> list[int]:
        card = self._card(h, "nvmlDeviceGetMigMode")
        if card.mig_on is None:
            raise _NVMLError(_NOT_SUPPORTED, "Not Supported")
        return [int(card.mig_on), int(card.mig_on)]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: tuple) -> int:
        return len(self._card(h, "nvmlDeviceGetMaxMigDeviceCount").instances)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: tuple, slot: int) -> tuple:
        if self.cards[h[1]].instances[slot] is None:
            raise _NVMLError(_NOT_FOUND, "Not Found")
        return ("mig", h[1], slot)


def test_live_cards_read_each_cards_memory_anew_and_name_one_that_fails() -> None:
    """LiveCards reads NVML at every call (by index where nvidia-ml-py has no
    nvmlDeviceGetHandleByUUID): a card whose free memory changed since discovery says so; a
    card whose memory call fails keeps its identity with NVML's reason, the other is read."""
    first, second = Card("NVIDIA L4", 23034, free_mb=20000), Card("NVIDIA L4", 23034)
    nvml = FakeNVML([first, second])
    live = gpus.LiveCards(gpus.discover(nvml=nvml).gpus, nvml)
    assert [(c["memory_free_mb"], c["error"]) for c in live.read()] == [(20000, ""),
                                                                       (23034, "")]
    first.free_mb = 500
    second.fail = {"nvmlDeviceGetMemoryInfo"}
    cards = live.read()
    assert (cards[0]["memory_free_mb"], cards[0]["error"]) == (500, "")
    assert (cards[1]["uuid"], cards[1]["memory_free_mb"]) == ("GPU-1", 0)
    assert cards[1]["error"] == "Unknown Error"
    assert gpus.lost_card_warnings(cards)[0].startswith(
        "GPU 1 (NVIDIA L4, GPU-1) stopped answering NVML (Unknown Error)")


def test_live_cards_when_nvml_does_not_start_name_every_card() -> None:
    class Down(FakeNVML):
        def nvmlInit(self) -> None:
            raise self.NVMLError(9, "Driver Not Loaded")

    found = gpus.discover(nvml=FakeNVML([Card("NVIDIA L4", 23034)]))
    cards = gpus.LiveCards(found.gpus, Down([Card("NVIDIA L4", 23034)])).read()
    assert [(c["uuid"], c["error"]) for c in cards] == [
        ("GPU-0", "NVML does not start: Driver Not Loaded")]
    # Negative control: no card, nothing read and nothing named.
    assert gpus.LiveCards([], Down([])).read() == []
