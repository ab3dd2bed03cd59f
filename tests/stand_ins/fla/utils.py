"""Stand-in of ``fla.utils``: only ``IS_NPU`` (FLA 0.5.2 ``fla/utils/_device.py``, 0.6.0 ``fla/utils/hardware.py``:
triton's active driver is triton-ascend's). True where torch's PrivateUse1 is named ``npu`` (torch_npu or the simulated Ascend host)."""

import torch

IS_NPU = torch._C._get_privateuse1_backend_name() == "npu"
