"""RMSNorm and SwiGLU fusion on transformers' real Qwen2 modeling code: exact counts and parity."""

import pytest
import torch

from conftest import assert_parity
from qwen_npu_compile.check.models import tiny_qwen2

LAYERS = 2
CORE = {"fusions": "rms_norm,swiglu"}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_exact_counts_and_parity(npu_ops, dtype, train, dynamic):
    model = tiny_qwen2(dtype).train(train)
    input_ids = torch.randint(0, 128, (2, 16))
    reports = assert_parity(model, input_ids, train, dtype, options=CORE, dynamic=dynamic or None)
    assert len(reports) == 1
    report = reports[0]
    assert report.simulated is True
    assert report.fusions == {"rms_norm": 2 * LAYERS + 1, "swiglu": LAYERS}
    assert [r for r in report.refused if r.family in report.families] == []
    if train:
        assert report.aot_ops["forward"] == {"npu_rms_norm": 2 * LAYERS + 1, "npu_swiglu": LAYERS}
    else:  # inference graph: 2L norms follow a residual add (patterns/rms_norm.py)
        assert report.aot_ops["forward"] == {"npu_rms_norm": 1, "npu_add_rms_norm": 2 * LAYERS, "npu_swiglu": LAYERS}
    if train:
        assert report.aot_ops["backward"] == {"npu_rms_norm_backward": 2 * LAYERS + 1, "npu_swiglu_backward": LAYERS}
    else:
        assert "backward" not in report.aot_ops


def test_dynamic_sequence_length_reuses_one_graph(npu_ops):
    model = tiny_qwen2(torch.bfloat16).eval()
    compiled = torch.compile(model, backend="qwen_npu", options=CORE, dynamic=True)
    with torch.no_grad():
        for seq_len in (8, 13, 21):
            ids = torch.randint(0, 128, (1, seq_len))
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=5e-2, rtol=5e-2)
    from qwen_npu_compile import get_reports

    assert [r.fusions for r in get_reports()] == [{"rms_norm": 5, "swiglu": 2}]


def test_bf16_activations_with_fp32_norm_weight_keep_hf_promotion(npu_ops):
    """vllm #48324: bf16 input with fp32 weight; HF returns fp32 there, so must the fused graph."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = Qwen2RMSNorm(64, eps=1e-6)  # fp32 weight
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    eager = norm(x)
    compiled = torch.compile(norm, backend="qwen_npu", options=CORE)(x)
    assert compiled.dtype == eager.dtype == torch.float32
    torch.testing.assert_close(compiled, eager, atol=3e-2, rtol=1e-2)
    from qwen_npu_compile import get_reports

    assert [r.fusions["rms_norm"] for r in get_reports()] == [1]
