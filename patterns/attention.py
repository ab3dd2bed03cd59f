"""Attention (SDPA and the eager chain) -> ``npu_fusion_attention``. SKELETON: being written (issue 3)."""

from __future__ import annotations

import torch

from qwen_npu_compile.fusion import FusionFamily

aten = torch.ops.aten


class AttentionFamily(FusionFamily):
    """SDPA / eager attention after repeat_kv -> ``npu_fusion_attention``; 1 per layer."""

    name = "attention"
    anchor_ops = ()
    fused_op_names = ("npu_fusion_attention",)

    def iter_variants(self):
        return iter(())
