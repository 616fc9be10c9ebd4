"""NVIDIA GPUs of this machine: NVML for what the driver sees (the cards once at start, then
each card's memory at every heartbeat: LiveCards), the PCI bus for what it should, and the
class a card's name makes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
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
    """One device CUDA can run on: a whole GPU, or one MIG instance of a GPU in MIG mode.

    A property NVML could not read has its zero value ("" or 0) and is named in `unknown`.
    A MIG instance has its own UUID ("MIG-..."), its own memory, its parent's index, name
    and compute capability, and `mig_parent` = the parent GPU's UUID.
    """

    index: int
    name: str
    memory_mb: int
    uuid: str
    gpu_class: str = ""
    memory_free_mb: int = 0
    compute_capability: str = ""
    mig_parent: str = ""
    unknown: tuple[str, ...] = ()

    def as_dict(self) -> Gpu:
        return {"index": self.index, "name": self.name, "memory_mb": self.memory_mb,
                "uuid": self.uuid, "class": self.gpu_class,
                "memory_free_mb": self.memory_free_mb,
                "compute_capability": self.compute_capability, "mig_parent": self.mig_parent,
                "unknown": list(self.unknown)}


@dataclass(frozen=True)
class Discovery:
    """What this machine has: the GPUs NVML sees, the driver, and warnings a person must
    act on. cuda_driver is the newest CUDA the driver runs ("12.4"; "" when unknown)."""

    gpus: list[GPU] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    cuda_driver: str = ""
    driver_version: str = ""

    def classes(self) -> list[str]:
        return list(dict.fromkeys(g.gpu_class for g in self.gpus))

    def cuda_archs(self) -> list[str]:
        """The CUDA architectures to build for ("90", "80"), newest first; GPUs whose compute
        capability is unknown add none."""
        archs = {g.compute_capability.replace(".", "") for g in self.gpus
                 if g.compute_capability}
        return sorted(archs, key=_arch_key, reverse=True)


def _arch_key(arch: str) -> tuple[int, str]:
    digits = "".join(c for c in arch if c.isdigit())
    return int(digits or 0), arch


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


class _Reader:
    """NVML calls where a failed or missing call makes one property unknown, not the whole
    machine. What failed is kept by device, for the warning that names it; calls missing
    from nvidia-ml-py are kept once for the machine (every device lacks them alike)."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.failed: list[str] = []
        self.missing: dict[str, str] = {}

    def call(self, prop: str, fn: str, *args: Any, quiet: tuple[int, ...] = ()) -> Any:
        """nvml.fn(*args), or None when it fails (recorded, unless its error code is quiet)."""
        method = getattr(self.nvml, fn, None)
        if method is None:
            self.missing.setdefault(fn, prop)
            return None
        try:
            return method(*args)
        except self.nvml.NVMLError as e:
            if getattr(e, "value", None) not in quiet:
                self.failed.append(f"{prop} ({fn}: {e})")
            return None

    def take(self) -> list[str]:
        failed, self.failed = self.failed, []
        return failed


@dataclass
class _Seen:
    """What one pass over NVML found."""

    gpus: list[GPU] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    cuda_driver: str = ""
    driver_version: str = ""


def nvml_gpus(nvml: Any = None) -> list[GPU]:
    """The GPUs NVML sees; none when the library, the driver or the devices are absent."""
    try:
        seen = _nvml_seen(nvml)
    except _NoNVML:
        return []
    return seen.gpus if seen else []


class _NoNVML(Exception):
    """nvmlInit failed; the message is NVML's reason."""


def _nvml_seen(nvml: Any = None) -> _Seen | None:
    """NVML's view; None without nvidia-ml-py; _NoNVML when NVML cannot start (no library,
    no driver)."""
    nvml = nvml if nvml is not None else _load_nvml()
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        raise _NoNVML(str(e)) from None
    try:
        return _read_all(_Reader(nvml))
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def _read_all(reader: _Reader) -> _Seen:
    seen = _Seen(
        cuda_driver=_cuda_version(reader.call("CUDA version", "nvmlSystemGetCudaDriverVersion")),
        driver_version=_text(reader.call("version", "nvmlSystemGetDriverVersion") or ""))
    driver_failed = reader.take()
    count = reader.call("count", "nvmlDeviceGetCount")
    if count is None:
        why = "; ".join(reader.take()) or "nvmlDeviceGetCount is missing from nvidia-ml-py"
        seen.warnings.append(f"the NVIDIA driver answers but cannot count its GPUs ({why}); "
                             "look at `nvidia-smi`; until NVML lists them this node serves on CPU")
        return seen
    for index in range(count):
        gpus, warnings = _device(reader, index)
        seen.gpus += gpus
        seen.warnings += warnings
    if reader.missing and seen.gpus:
        seen.warnings.append(_missing_warning(reader.missing))
    if driver_failed and seen.gpus and not seen.cuda_driver:
        seen.warnings.append(
            f"NVML could not read the driver's {'; '.join(driver_failed)}, so the GPU engine is "
            "built for CUDA 12; look at the driver with `nvidia-smi`")
    return seen


def _missing_warning(missing: dict[str, str]) -> str:
    calls = ", ".join(missing)
    props = ", ".join(dict.fromkeys(missing.values()))
    cuda12 = (", and the GPU engine is built for CUDA 12"
              if "nvmlSystemGetCudaDriverVersion" in missing else "")
    return (f"the installed nvidia-ml-py lacks {calls}, so these are unknown on every GPU: "
            f"{props}{cuda12}; update it in llmgw's environment "
            "(`pip install -U nvidia-ml-py`) and restart the agent")


def _device(reader: _Reader, index: int) -> tuple[list[GPU], list[str]]:
    """GPU `index` (or its MIG instances), and a warning for what NVML could not read."""
    handle = reader.call("handle", "nvmlDeviceGetHandleByIndex", index)
    if handle is None:
        return [], [f"NVML cannot open GPU {index} ({'; '.join(reader.take())}), so this node "
                    f"leaves it out; look at it with `nvidia-smi -i {index}` (a GPU that fell "
                    "off the bus needs a reset or a reboot)"]
    gpu = _whole(reader, handle, index)
    mode = reader.call("MIG mode", "nvmlDeviceGetMigMode", handle, quiet=_NOT_SUPPORTED)
    warnings = _unread(gpu, reader.take())
    if not mode or mode[0] != _MIG_ENABLE:
        return [gpu], warnings
    instances = []
    for mig in _mig_handles(reader, handle):
        instance = _instance(reader, mig, gpu)
        instances.append(instance)
        warnings += _unread(instance, reader.take())
    if not instances:
        warnings.append(
            f"GPU {index} ({gpu.name}, {gpu.uuid}) is in MIG mode but has no MIG instances, so "
            "nothing can run on it: create some (`nvidia-smi mig -cgi <profiles> -C`) or turn "
            f"MIG off (`nvidia-smi -i {index} -mig 0`)")
    return instances, warnings


_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_NOT_FOUND = 6
_NOT_SUPPORTED = (_NVML_ERROR_NOT_SUPPORTED,)
_MIG_ENABLE = 1


def _whole(reader: _Reader, handle: Any, index: int) -> GPU:
    name = _text(reader.call("name", "nvmlDeviceGetName", handle) or "")
    uuid = _text(reader.call("uuid", "nvmlDeviceGetUUID", handle) or "")
    total, free = _memory(reader, handle)
    cc = _capability(reader.call("compute capability", "nvmlDeviceGetCudaComputeCapability",
                                 handle))
    return _gpu(index, name, uuid, total, free, cc, gpu_class(name, total or 0) if name else "")


def _mig_handles(reader: _Reader, parent: Any) -> list[Any]:
    count = reader.call("MIG instances", "nvmlDeviceGetMaxMigDeviceCount", parent) or 0
    # An empty slot answers NOT_FOUND: MIG instances need not fill the slots in order.
    handles = [reader.call("MIG instance", "nvmlDeviceGetMigDeviceHandleByIndex", parent, slot,
                           quiet=(_NVML_ERROR_NOT_FOUND,)) for slot in range(count)]
    return [h for h in handles if h is not None]


def _instance(reader: _Reader, handle: Any, parent: GPU) -> GPU:
    """A MIG instance: its own UUID and memory; its parent's index, class and capability."""
    name = _text(reader.call("name", "nvmlDeviceGetName", handle) or "") or parent.name
    uuid = _text(reader.call("uuid", "nvmlDeviceGetUUID", handle) or "")
    total, free = _memory(reader, handle)
    return _gpu(parent.index, name, uuid, total, free, parent.compute_capability,
                parent.gpu_class, mig_parent=parent.uuid)


def _gpu(index: int, name: str, uuid: str, total: int | None, free: int | None, cc: str,
         klass: str, mig_parent: str = "") -> GPU:
    read = {"name": name, "uuid": uuid, "memory_mb": total, "memory_free_mb": free,
            "compute_capability": cc}
    unknown = tuple(prop for prop, value in read.items() if value in ("", None))
    return GPU(index, name, total or 0, uuid, klass, free or 0, cc, mig_parent, unknown)


def _memory(reader: _Reader, handle: Any) -> tuple[int | None, int | None]:
    info = reader.call("memory", "nvmlDeviceGetMemoryInfo", handle)
    if info is None:
        return None, None
    return int(info.total) // _MIB, int(info.free) // _MIB


_MIB = 1024 * 1024


def _unread(gpu: GPU, failed: list[str]) -> list[str]:
    if not failed:
        return []
    what = ", ".join(p for p in (gpu.name, gpu.uuid) if p)
    return [f"NVML could not read GPU {gpu.index}{f' ({what})' if what else ''}: "
            f"{'; '.join(failed)}; the node keeps the GPU with these unknown. Look at it with "
            f"`nvidia-smi -q -i {gpu.index}`"]


def _capability(cc: Any) -> str:
    if not cc:
        return ""
    major, minor = cc
    return f"{int(major)}.{int(minor)}"


def _cuda_version(value: int | None) -> str:
    """NVML's CUDA version number (12040) as a version ("12.4")."""
    if not value:
        return ""
    return f"{value // 1000}.{value % 1000 // 10}"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class LiveCards:
    """The cards discovery found, as they are at each read (each heartbeat): free and used
    memory from NVML then. A card that stops answering keeps its place and identity, with
    `error` saying NVML's reason and no free memory; the others are read as ever. NVML is
    started once, and again after it failed to."""

    def __init__(self, gpus: list[GPU], nvml: Any = None) -> None:
        self.gpus = list(gpus)
        self._nvml = nvml
        self._started = False

    def read(self) -> list[Gpu]:
        if not self.gpus:
            return []
        nvml = self._nvml if self._nvml is not None else _load_nvml()
        if nvml is None:  # no nvidia-ml-py: nothing to read anew (discovery said so)
            return [g.as_dict() for g in self.gpus]
        if not self._started:
            try:
                nvml.nvmlInit()
            except nvml.NVMLError as e:
                return [_unanswered(g, f"NVML does not start: {e}") for g in self.gpus]
            self._started = True
        return [self._card(nvml, g) for g in self.gpus]

    def _card(self, nvml: Any, gpu: GPU) -> Gpu:
        if gpu.mig_parent and getattr(nvml, "nvmlDeviceGetHandleByUUID", None) is None:
            return gpu.as_dict()  # an instance is reached by its UUID alone: as discovered
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(_handle(nvml, gpu))
        except nvml.NVMLError as e:
            return _unanswered(gpu, str(e) or type(e).__name__)
        card = gpu.as_dict()
        card["memory_free_mb"] = int(info.free) // _MIB
        card["memory_used_mb"] = int(info.used) // _MIB
        card["error"] = ""
        if info.total:
            card["memory_mb"] = int(info.total) // _MIB
        card["unknown"] = [u for u in gpu.unknown if u not in ("memory_mb", "memory_free_mb")]
        return card


def _handle(nvml: Any, gpu: GPU) -> Any:
    """The card's NVML handle by its UUID (a MIG instance's too), else a whole GPU's by
    index; NVMLError when it does not answer."""
    by_uuid = getattr(nvml, "nvmlDeviceGetHandleByUUID", None)
    if gpu.uuid and by_uuid is not None:
        return by_uuid(gpu.uuid.encode())
    return nvml.nvmlDeviceGetHandleByIndex(gpu.index)


def _unanswered(gpu: GPU, why: str) -> Gpu:
    card = gpu.as_dict()
    card["memory_free_mb"] = card["memory_used_mb"] = 0
    card["error"] = why
    return card


def lost_card_warnings(cards: list[Gpu]) -> list[str]:
    """A line for each card that stopped answering NVML: what a person must look at."""
    return [f"GPU {c.get('index')} ({c.get('name') or '?'}, {c.get('uuid') or '?'}) stopped "
            f"answering NVML ({c['error']}), so no new replica goes there; look at it with "
            f"`nvidia-smi -q -i {c.get('index')}` (a GPU that fell off the bus needs a reset "
            "or a reboot)" for c in cards if c.get("error")]


def no_driver_warning(cards: list[str], reason: str = "") -> str:
    why = f" ({reason})" if reason else ""
    return (
        f"an NVIDIA card is on the PCI bus ({', '.join(cards)}) but NVML cannot see it{why}: "
        "install the NVIDIA driver (or, after a driver update, reboot) and run again to "
        "serve on it; until then this node serves on CPU"
    )


def discover(nvml: Any = None, pci_root: Path = PCI_DEVICES) -> Discovery:
    """GPUs through NVML; a card on the bus that NVML misses becomes a warning."""
    try:
        seen = _nvml_seen(nvml)
    except _NoNVML as e:
        seen, reason = None, str(e)
    else:
        reason = ""
    if seen and (seen.gpus or seen.warnings):
        return Discovery(seen.gpus, seen.warnings, seen.cuda_driver, seen.driver_version)
    cards = nvidia_cards_on_bus(pci_root)
    return Discovery([], [no_driver_warning(cards, reason)] if cards else [])
