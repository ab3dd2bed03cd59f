"""A family switched off in the options fuses nothing and says why (its matches are refused as disabled), and
strict mode does not count a disabled family's matches as misses."""

import torch

from qwen_npu_compile import get_reports
from qwen_npu_compile.cli.check.models import tiny_qwen2


def test_disabled_family_fuses_nothing_and_says_why(npu_ops):
    model = tiny_qwen2().eval()
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        torch.compile(model, backend="qwen_npu", options={"fusions": "rms_norm"})(ids)
    (report,) = get_reports()
    assert report.families == ["rms_norm"]
    assert report.fusions == {"rms_norm": 5}
    swiglu = [r for r in report.refused if r.family == "swiglu"]
    assert len(swiglu) == 2
    assert all("disabled" in r.reason and r.source.startswith("modeling_qwen2.py:") for r in swiglu)


def test_strict_mode_ignores_disabled_families(npu_ops):
    model = tiny_qwen2().eval()
    with torch.no_grad():
        torch.compile(model, backend="qwen_npu", options={"fusions": "rms_norm", "strict": "1"})(torch.randint(0, 128, (1, 8)))
    (report,) = get_reports()
    assert report.fusions == {"rms_norm": 5}
