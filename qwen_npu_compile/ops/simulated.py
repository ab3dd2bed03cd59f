"""The simulated stand-ins of torch_npu's ops, registered where torch_npu does not import.

:func:`register` defines every module of :data:`STAND_INS` in one ``torch.library.Library("npu", "FRAGMENT")``;
:func:`qwen_npu_compile.ops.ensure_npu_ops` calls it once per process, only when torch_npu is absent, and keeps the
library alive for the lifetime of the process. The simulated Ascend host of the tests registers the same modules
on its own device library.
"""

from __future__ import annotations

import torch

from qwen_npu_compile.ops.torch_npu import (
    add_rms_norm,
    fusion_attention,
    grouped_matmul,
    moe_token_permute,
    rms_norm,
    rotary_mul,
    swiglu,
)

#: The stand-in modules, each with ``register(lib)``: every op of ``EMITTED_OPS`` with its backward op, and
#: ``npu_moe_token_permute`` (not emitted by this project: verl's npu_patch MoE block calls it).
STAND_INS = (rms_norm, add_rms_norm, swiglu, rotary_mul, fusion_attention, grouped_matmul, moe_token_permute)


def register(lib: torch.library.Library | None = None) -> torch.library.Library:
    """Define every stand-in of :data:`STAND_INS` in ``lib`` (a new ``npu`` fragment when None); returns it."""
    lib = torch.library.Library("npu", "FRAGMENT") if lib is None else lib
    for module in STAND_INS:
        module.register(lib)
    return lib
