"""Where ``check`` puts the model and its inputs: the NPU on an Ascend host, else the CPU.

An Ascend host is one where torch_npu imports (:func:`qwen_npu_compile.ops.ensure_npu_ops` imports it, as
transformers and verl do) and ``torch.npu.is_available()`` is True: the fused ops there are torch_npu's, which run
on NPU tensors only, so the model must be on the NPU. Everywhere else the npu ops are this package's simulated
stand-ins, which run on CPU tensors.
"""

from __future__ import annotations

import torch

from qwen_npu_compile.ops import NpuOpsStatus


def check_device(status: NpuOpsStatus) -> torch.device:
    """``npu:<current>`` where torch_npu is real (``status``) and ``torch.npu.is_available()``; else ``cpu``."""
    npu = getattr(torch, "npu", None)
    if not status.simulated and npu is not None and npu.is_available():
        return torch.device("npu", npu.current_device())
    return torch.device("cpu")


def describe_device(device: torch.device, status: NpuOpsStatus) -> str:
    """One line naming the device the check runs on and why (printed by ``check``)."""
    if device.type == "npu":
        name = torch.npu.get_device_name(device.index)
        return f"device: {device} ({name}, torch_npu {status.torch_npu_version}): model and inputs on the NPU"
    why = status.reason if status.simulated else "torch_npu imported but torch.npu.is_available() is False"
    return f"device: cpu (no NPU: {why}; the npu ops are {status.kind})"


def device_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device`` in bytes (``torch.npu.mem_get_info``), 0 for the CPU or when unknown."""
    if device.type != "npu":
        return 0
    try:
        return int(torch.npu.mem_get_info(device.index)[0])
    except Exception:  # noqa: BLE001 - an unknown amount is "no limit known"
        return 0
