"""NVIDIA GPUs of this machine: NVML for what the driver sees, the PCI bus for what it should."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from llmgw.contract.records import Gpu

PCI_DEVICES = Path("/sys/bus/pci/devices")
NVIDIA_VENDOR = "0x10de"

# Words that name the maker or a product line, not the chip.
_BRAND_WORDS = {"nvidia", "tesla", "geforce", "quadro"}
_FILLER_WORDS = {"generation", "gpu"}
# Tokens that begin the form-factor / memory part of a name: the chip's name is over.
_FORM_TOKEN = re.compile(r"^(sxm\d*|pcie|nvl|hbm\d*e?|\d+gb|mig)$", re.IGNORECASE)
_MEMORY_IN_NAME = re.compile(r"(\d+)\s*GB", re.IGNORECASE)
# Chips sold with more than one memory size, and the sizes (GB): their class names the size.
MULTI_SIZE: dict[str, tuple[int, ...]] = {
    "a100": (40, 80),
    "a800": (40, 80),
    "h100": (80, 94),
    "h800": (80, 94),
    "v100": (16, 32),
    "p100": (12, 16),
}


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    memory_mb: int
    uuid: str
    gpu_class: str = ""

    def as_dict(self) -> Gpu:
        d = asdict(self)
        d["class"] = d.pop("gpu_class")
        return d  # type: ignore[return-value]


@dataclass(frozen=True)
class Discovery:
    """What this machine has: the GPUs NVML sees, and warnings a person must act on."""

    gpus: list[GPU] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def classes(self) -> list[str]:
        return list(dict.fromkeys(g.gpu_class for g in self.gpus))


def gpu_class(name: str, memory_mb: int = 0) -> str:
    """The class of a GPU, from its NVML name (and memory for chips sold in several sizes).

    The rule: split the name on spaces and hyphens; drop the maker and product-line words
    (NVIDIA, Tesla, GeForce, Quadro) and filler (Generation, GPU); stop at the first
    form-factor or memory token (SXM4, PCIe, NVL, HBM3, 80GB, MIG); join what is left,
    lowercased, with hyphens. A chip sold with several memory sizes (A100, A800, H100, H800,
    V100, P100) gets `-<N>gb`, N from the name when it says, else NVML's memory rounded to
    the nearest size sold. So "NVIDIA A100-SXM4-80GB" is a100-80gb, "NVIDIA H200" is h200,
    "NVIDIA GeForce RTX 4090" is rtx-4090 and "Tesla T4" is t4.
    """
    words: list[str] = []
    for token in re.split(r"[\s\-]+", name.strip()):
        if not token or token.lower() in _BRAND_WORDS | _FILLER_WORDS:
            continue
        if _FORM_TOKEN.match(token):
            break
        words.append(token.lower())
    chip = "-".join(words) or "unknown"
    sizes = MULTI_SIZE.get(chip)
    if sizes is None:
        return chip
    size = _memory_gb(name, memory_mb, sizes)
    return f"{chip}-{size}gb" if size else chip


def _memory_gb(name: str, memory_mb: int, sizes: tuple[int, ...]) -> int:
    said = _MEMORY_IN_NAME.search(name)
    if said:
        return int(said.group(1))
    if memory_mb <= 0:
        return 0
    gb = memory_mb / 1024
    return min(sizes, key=lambda s: abs(s - gb))


def nvidia_cards_on_bus(root: Path = PCI_DEVICES) -> list[str]:
    """PCI addresses of NVIDIA display or 3D controllers, driver or not.

    Class 0x03xxxx is a display controller; NVIDIA also makes bridges and audio
    functions, which are no GPU.
    """
    found = []
    for vendor in sorted(root.glob("*/vendor")):
        if _read(vendor) != NVIDIA_VENDOR:
            continue
        if _read(vendor.parent / "class").startswith("0x03"):
            found.append(vendor.parent.name)
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text().strip().lower()
    except OSError:
        return ""


def _load_nvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def nvml_gpus(nvml: Any = None) -> list[GPU]:
    """The GPUs NVML sees; none when the library, the driver or the devices are absent."""
    nvml = nvml if nvml is not None else _load_nvml()
    if nvml is None:
        return []
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return []
    try:
        return [_gpu(nvml, i) for i in range(nvml.nvmlDeviceGetCount())]
    except nvml.NVMLError:
        return []
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _gpu(nvml: Any, index: int) -> GPU:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = _text(nvml.nvmlDeviceGetName(handle))
    memory_mb = int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024)
    uuid = _text(nvml.nvmlDeviceGetUUID(handle))
    return GPU(index, name, memory_mb, uuid, gpu_class(name, memory_mb))


def no_driver_warning(cards: list[str]) -> str:
    return (
        f"an NVIDIA card is on the PCI bus ({', '.join(cards)}) but NVML cannot see it: "
        "install the NVIDIA driver and run again to serve on it; until then this node "
        "serves on CPU"
    )


def discover(nvml: Any = None, pci_root: Path = PCI_DEVICES) -> Discovery:
    """GPUs through NVML; a card on the bus that NVML misses becomes a warning."""
    gpus = nvml_gpus(nvml)
    if gpus:
        return Discovery(gpus)
    cards = nvidia_cards_on_bus(pci_root)
    return Discovery([], [no_driver_warning(cards)] if cards else [])
