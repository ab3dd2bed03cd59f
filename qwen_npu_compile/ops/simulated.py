"""Registers the simulated stand-ins for every op in ``EMITTED_OPS`` (import for the side effect).

Only :func:`qwen_npu_compile.ops.ensure_npu_ops` imports this module, and only when torch_npu is
absent. One ``torch.library.Library("npu", "FRAGMENT")`` holds all registrations; it must stay alive for
the lifetime of the process.
"""

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

LIBRARY = torch.library.Library("npu", "FRAGMENT")

# moe_token_permute: not emitted by this project, called by verl's npu_patch MoE block
for _module in (rms_norm, add_rms_norm, swiglu, rotary_mul, fusion_attention, grouped_matmul, moe_token_permute):
    _module.register(LIBRARY)
