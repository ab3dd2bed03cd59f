"""MoE (issue 20): tiny Qwen3-MoE and Qwen2-MoE of transformers' real modeling code, whole model.

The router's ``softmax -> topk`` is not attention (no near miss, so ``strict`` passes).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from conftest import assert_parity

LAYERS = 2
_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, use_cache=False, moe_intermediate_size=32,
             num_experts=4, num_experts_per_tok=2)  # fmt: skip


def tiny_moe(family: str, dtype=torch.float32):
    """A 2-layer tiny Qwen3-MoE (head_dim 64, top-2 of 4 experts, renormalised) or Qwen2-MoE (head_dim 16,
    shared expert and its sigmoid gate), random weights, in ``dtype``."""
    torch.manual_seed(0)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**_TINY, head_dim=64, norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.Qwen2MoeConfig(**_TINY, shared_expert_intermediate_size=64)
        cls = transformers.Qwen2MoeForCausalLM
    return cls._from_config(config, attn_implementation="sdpa").to(dtype)


def _ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_router_softmax_is_no_attention_near_miss_strict_passes(family):
    model = tiny_moe(family, torch.bfloat16)
    reports = assert_parity(model, _ids(), True, torch.bfloat16, options={"strict": True})
    assert [r.reason for report in reports for r in report.refused] == []
    assert sum(report.fusions["attention"] for report in reports) == LAYERS
    # the two router softmaxes are not counted as attention anchors either
    assert sum(report.anchors["attention"] for report in reports) == LAYERS
