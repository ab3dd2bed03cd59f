"""``torch_npu.npu.utils`` of the simulated Ascend host: the CANN version queries torchair makes."""

from __future__ import annotations

#: the CANN release the simulated host reports (torch_npu 2.13.0 pairs with CANN 8.5)
CANN_VERSION = "8.5.0"


def get_cann_version(module: str = "CANN") -> str:
    return CANN_VERSION


def _is_gte_cann_version(version: str, module: str = "CANN") -> bool:
    def parts(text):
        return [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in text.split(".")]

    return parts(CANN_VERSION) >= parts(version)


def get_device_name(device=None) -> str:
    from . import get_device_name as name

    return name(device)
