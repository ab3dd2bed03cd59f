"""Issue 12: the shared attention mask is converted once per forward, not once per layer."""

import pytest
import torch

from qwen_npu_compile.cli.check.models import tiny_qwen2
from qwen_npu_compile.ops.limits import bound_arguments
from tests.helpers.numerics import assert_parity

LAYERS = 3


@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_one_mask_conversion_for_all_layers(npu_ops, rewritten, train):
    model = tiny_qwen2(torch.float32, num_hidden_layers=LAYERS).train(train)
    ids = torch.randint(0, 128, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :5] = 0  # left padding: an explicit mask reaches every layer
    reports = assert_parity(model, ids, train, torch.float32, options={"downstream": "aot_eager"}, attention_mask=mask)
    assert [r.fusions["attention"] for r in reports] == [LAYERS]
    (gm,) = rewritten
    fused = gm.graph.find_nodes(op="call_function", target=torch.ops.npu.npu_fusion_attention.default)
    masks = {node.kwargs.get("atten_mask", node.args[7] if len(node.args) > 7 else None) for node in fused}
    assert len(masks) == 1  # every layer's npu_fusion_attention reads the same converted mask
    (node,) = masks
    assert node.target is torch.ops.aten.logical_not.default


@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_one_compressed_causal_mask_for_all_layers(npu_ops, rewritten, train):
    """Without a padding mask the mask is provably causal: every layer takes sparse_mode 2 and the
    2048x2048 compressed mask, built once per graph (ones + triu), not once per layer."""
    model = tiny_qwen2(torch.float32, num_hidden_layers=LAYERS).train(train)
    reports = assert_parity(model, torch.randint(0, 128, (2, 16)), train, torch.float32, options={"downstream": "aot_eager"})
    assert [r.fusions["attention"] for r in reports] == [LAYERS]
    (gm,) = rewritten
    fused = gm.graph.find_nodes(op="call_function", target=torch.ops.npu.npu_fusion_attention.default)
    bound = [bound_arguments(n) for n in fused]
    masks = {b["atten_mask"] for b in bound}
    assert [b["sparse_mode"] for b in bound] == [2] * LAYERS
    assert len(masks) == 1 and [tuple(m.meta["val"].shape) for m in masks] == [(2048, 2048)]
    assert len(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.ones.default)) == 1
    assert len(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.triu.default)) == 1
