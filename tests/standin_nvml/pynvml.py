"""A stand-in for nvidia-ml-py's `pynvml` on a machine without a GPU: the NVML calls
llmgw.agent.gpus makes, answering for the cards LLMGW_STANDIN_GPUS names
(`NAME:MEMORY_MB:CC;...`, default one H100 80GB HBM3). Put this folder first on
PYTHONPATH of a process (and of the services it starts) to make it see those cards; the
CUDA driver itself is not there, so a CUDA engine built or checked against it fails,
as a test of that path wants. Only the driver's library is stood in for.

A test changes the cards while a process runs through the file LLMGW_STANDIN_NVML_STATE
names (JSON, read afresh at every call): `{"used_mib": {"0": 70000}}` makes card 0 show
that much memory used, as a foreign process filling it would; `{"lost": [1]}` makes
card 1 stop answering (every call on it raises NVMLError, "GPU is lost")."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

_DEFAULT = "NVIDIA H100 80GB HBM3:81559:9.0"


class NVMLError(Exception):
    def __init__(self, value: int = 999, text: str = "Unknown Error") -> None:
        super().__init__(text)
        self.value = value


NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_GPU_IS_LOST = 15


def _state() -> dict:
    path = os.environ.get("LLMGW_STANDIN_NVML_STATE")
    if not path:
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _answering(h: int) -> None:
    if h in _state().get("lost", []):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST, "GPU is lost")


def _cards() -> list[tuple[str, int, tuple[int, int]]]:
    cards = []
    for entry in (os.environ.get("LLMGW_STANDIN_GPUS") or _DEFAULT).split(";"):
        name, memory, cc = entry.split(":")
        major, minor = cc.split(".")
        cards.append((name, int(memory), (int(major), int(minor))))
    return cards


def nvmlInit() -> None:
    pass


def nvmlShutdown() -> None:
    pass


def nvmlSystemGetCudaDriverVersion() -> int:
    # A 550 driver's CUDA 12.4 by default: the most common GPU host, whose engine needs a
    # CUDA 12 toolkit that cannot be assembled from wheels (so nothing is downloaded).
    return int(os.environ.get("LLMGW_STANDIN_CUDA_DRIVER") or 12040)


def nvmlSystemGetDriverVersion() -> str:
    return "550.54.15 (stand-in)"


def nvmlDeviceGetCount() -> int:
    return len(_cards())


def nvmlDeviceGetHandleByIndex(i: int) -> int:
    return i


def nvmlDeviceGetHandleByUUID(uuid: bytes | str) -> int:
    text = uuid.decode() if isinstance(uuid, bytes) else uuid
    for h in range(len(_cards())):
        if text == _uuid(h):
            return h
    raise NVMLError(6, "Not Found")


def nvmlDeviceGetName(h: int) -> str:
    _answering(h)
    return _cards()[h][0]


def nvmlDeviceGetMemoryInfo(h: int) -> SimpleNamespace:
    _answering(h)
    total = _cards()[h][1] * 2**20
    used_mib = _state().get("used_mib", {}).get(str(h))
    used = min(total, int(used_mib) * 2**20) if used_mib is not None else 2**30
    return SimpleNamespace(total=total, free=total - used, used=used)


def _uuid(h: int) -> str:
    return f"GPU-5ea1d1e0-0000-4000-8000-{h:012d}"


def nvmlDeviceGetUUID(h: int) -> str:
    _answering(h)
    return _uuid(h)


def nvmlDeviceGetCudaComputeCapability(h: int) -> tuple[int, int]:
    _answering(h)
    return _cards()[h][2]


def nvmlDeviceGetMigMode(h: int) -> list[int]:
    _answering(h)
    raise NVMLError(NVML_ERROR_NOT_SUPPORTED, "Not Supported")
