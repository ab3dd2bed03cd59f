"""Negative cases across families: a disabled family fuses nothing (and says why), strict mode ignores
disabled families, and graphs the pre-dispatch retrace cannot follow compile unfused with a warning
(a torch.vmap-built mask is desugared and fused). The negatives of one family are in
tests/patterns/test_<family>.py."""

import logging

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from qwen_npu_compile.check.models import tiny_qwen2
from qwen_npu_compile import get_reports

CORE = {"fusions": "rms_norm,swiglu"}


def _only_report():
    reports = get_reports()
    assert len(reports) == 1
    return reports[0]


def test_disabled_family_fuses_nothing_and_says_why(npu_ops):
    model = tiny_qwen2().eval()
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        torch.compile(model, backend="qwen_npu", options={"fusions": "rms_norm"})(ids)
    report = _only_report()
    assert report.families == ["rms_norm"]
    assert report.fusions == {"rms_norm": 5}
    swiglu = [r for r in report.refused if r.family == "swiglu"]
    assert len(swiglu) == 2
    assert all("disabled" in r.reason and r.source.startswith("modeling_qwen2.py:") for r in swiglu)


def test_strict_mode_ignores_disabled_families(npu_ops):
    model = tiny_qwen2().eval()
    with torch.no_grad():
        torch.compile(model, backend="qwen_npu", options={"fusions": "rms_norm", "strict": "1"})(torch.randint(0, 128, (1, 8)))
    assert _only_report().fusions == {"rms_norm": 5}


class VmapMaskedNorm(torch.nn.Module):
    """Builds a mask with torch.vmap, as transformers 4.5x masking_utils does (canonicalize desugars it)."""

    def __init__(self):
        super().__init__()
        self.norm = Qwen2RMSNorm(8)

    def forward(self, x):
        idx = torch.arange(x.shape[-2])
        mask = torch.vmap(lambda i: idx <= i)(idx)
        return self.norm(x).masked_fill(~mask, 0)


def test_vmap_built_mask_is_desugared_and_fused(npu_ops):
    module, x = VmapMaskedNorm(), torch.randn(2, 8, 8)
    out = torch.compile(module, backend="qwen_npu")(x)
    torch.testing.assert_close(out, module(x))
    report = _only_report()
    assert report.fallback is None and report.fusions["rms_norm"] == 1


def test_graph_that_cannot_be_retraced_runs_unfused_with_a_warning(npu_ops, caplog, monkeypatch):
    from qwen_npu_compile import canonicalize

    def fail(self, node):  # any retrace failure; tests/e2e/test_stack_compat.py covers a failing vmap region
        raise NotImplementedError("simulated retrace failure")

    monkeypatch.setattr(canonicalize._Retracer, "run_node", fail)
    module, x = VmapMaskedNorm(), torch.randn(2, 8, 8)
    with caplog.at_level(logging.WARNING, logger="qwen_npu_compile"):
        out = torch.compile(module, backend="qwen_npu")(x)
    torch.testing.assert_close(out, module(x))
    report = _only_report()
    assert report.fusions["rms_norm"] == 0
    assert "the pre-dispatch retrace failed: NotImplementedError" in report.fallback
    assert "compiling the graph unfused" in caplog.text
    torch._dynamo.reset()
    with pytest.raises(Exception, match="strict mode.*compiled unfused"):
        torch.compile(module, backend="qwen_npu", options={"strict": True})(x)
