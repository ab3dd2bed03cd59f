"""Rotary embedding (RoPE) -> ``npu_rotary_mul``. SKELETON: being written (issue 3)."""

from __future__ import annotations

import torch

from qwen_npu_compile.fusion import FusionFamily

aten = torch.ops.aten


class RotaryFamily(FusionFamily):
    """``x*cos + rotate_half(x)*sin`` -> ``npu_rotary_mul``; 2 per layer (q and k)."""

    name = "rotary"
    anchor_ops = ()
    fused_op_names = ("npu_rotary_mul",)

    def iter_variants(self):
        return iter(())
